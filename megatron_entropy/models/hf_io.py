"""Read and write Hugging Face model folders one tensor at a time (safetensors)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import IO, Iterable, Iterator, Optional, Sequence, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_entropy.models.hf_names import hf_weight_files

# Files that describe the model but are not weights; copied along with exported weights.
HF_METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                     "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                     "chat_template.json")


def copy_hf_metadata(src_dir: Union[str, Path], out_dir: Union[str, Path]) -> list[str]:
    """Copy config, generation config and tokenizer files that exist in ``src_dir``."""
    copied = []
    for name in HF_METADATA_FILES:
        src = Path(src_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(out_dir) / name)
            copied.append(name)
    return copied


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _remove_stale_temps(out_dir: Path) -> None:
    """Temporary siblings of ``out_dir`` left by a writer on this machine that was killed (its
    pid, in the name, is gone). A live writer's folder is left alone."""
    for old in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        pid = old.name.removeprefix(f".{out_dir.name}.tmp-").split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)


def temp_sibling(out_dir: Path) -> Path:
    """An empty folder beside ``out_dir`` to write into and rename, with the permissions a plain
    mkdir would give (mkdtemp's 0700 would outlive the rename). Its name holds this process's
    pid, so the next writer of ``out_dir`` removes it if this one was killed before cleaning up."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-",
                                dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    return tmp


# (name, shape, dtype) of one tensor a writer will receive, known before any data exists.
TensorSpec = tuple[str, Sequence[int], torch.dtype]

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def _nbytes(spec: TensorSpec) -> int:
    _, shape, dtype = spec
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class SafetensorsStream:
    """One safetensors file written tensor by tensor, in any order: the header comes first,
    computed from the specs, and each tensor goes to its planned offset, so no tensor has to be
    held after it is written."""

    def __init__(self, path: Path, specs: list[TensorSpec]) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in specs:
            name, shape, dtype = spec
            size = _nbytes(spec)
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
        data_start = 8 + len(raw)
        self.places = {name: (data_start + header[name]["data_offsets"][0], tuple(shape), dtype)
                       for name, shape, dtype in specs}
        self.pending = set(self.places)
        self.file: IO[bytes] = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        start, shape, dtype = self.places[name]
        if name not in self.pending:
            raise ValueError(f"tensor stream has {name} twice")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, expected {shape}")
        t = tensor.detach().to("cpu", dtype=dtype).contiguous().reshape(-1)
        self.file.seek(start)
        self.file.write(t.view(torch.uint8).numpy().data)
        self.pending.discard(name)

    def close(self) -> None:
        self.file.close()


def save_hf_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Union[str, Path],
                    metadata_from: Optional[Union[str, Path]] = None,
                    max_shard_bytes: int = 5 * 1024**3,
                    dtype: Optional[torch.dtype] = None,
                    specs: Optional[Sequence[TensorSpec]] = None) -> dict[str, float]:
    """Stream tensors into sharded ``model-0000i-of-0000n.safetensors`` files plus an index.

    Without ``specs`` at most one shard is held in memory. With ``specs`` (every tensor's name,
    shape and dtype) the shards are planned up front and each tensor goes to its place on disk as
    it arrives, in any order, so only one tensor is held; a tensor that does not match its spec,
    comes twice or is missing raises. The folder appears complete or not at all: it is written under a temporary name and
    renamed. Returns {"tensors", "bytes", "shards"}.
    """
    out_dir = Path(out_dir)
    tmp = temp_sibling(out_dir)
    try:
        if specs is None:
            shard_names, total_bytes = _write_buffered(named_tensors, tmp, max_shard_bytes, dtype)
        else:
            shard_names, total_bytes = _write_streamed(named_tensors, tmp, max_shard_bytes,
                                                       list(specs))
        n = len(shard_names)
        weight_map = {}
        for i, names in enumerate(shard_names):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp / f"shard-{i:05d}.safetensors", tmp / final)
            weight_map.update({name: final for name in names})
        if n > 1:
            write_weight_index(tmp, weight_map, total_bytes)
        if metadata_from is not None:
            copy_hf_metadata(metadata_from, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {"tensors": float(len(weight_map)), "bytes": float(total_bytes), "shards": float(n)}


def _write_buffered(named_tensors: Iterable[tuple[str, torch.Tensor]], tmp: Path,
                    max_shard_bytes: int, dtype: Optional[torch.dtype]
                    ) -> tuple[list[list[str]], int]:
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    shard_names: list[list[str]] = []
    total_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            save_file(shard, str(tmp / f"shard-{len(shard_names):05d}.safetensors"),
                      metadata={"format": "pt"})
            shard_names.append(list(shard))
            shard, shard_bytes = {}, 0

    for name, tensor in named_tensors:
        t = tensor.detach().to("cpu", dtype=dtype or tensor.dtype).contiguous()
        size = t.numel() * t.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name] = t
        shard_bytes += size
        total_bytes += size
    flush()
    return shard_names, total_bytes


def _write_streamed(named_tensors: Iterable[tuple[str, torch.Tensor]], tmp: Path,
                    max_shard_bytes: int, specs: list[TensorSpec], stem: str = "shard"
                    ) -> tuple[list[list[str]], int]:
    shards: list[list[TensorSpec]] = [[]]
    shard_bytes = 0
    for spec in specs:
        if shards[-1] and shard_bytes + _nbytes(spec) > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(spec)
        shard_bytes += _nbytes(spec)
    streams: list[SafetensorsStream] = []
    try:
        for i, shard in enumerate(shards):
            streams.append(SafetensorsStream(tmp / f"{stem}-{i:05d}.safetensors", shard))
        where = {name: stream for stream in streams for name in stream.places}
        for name, tensor in named_tensors:
            if name not in where:
                raise ValueError(f"tensor stream has {name}, which its specs do not list")
            where[name].write(name, tensor)
    finally:
        for stream in streams:
            stream.close()
    missing = [name for stream in streams for name in sorted(stream.pending)]
    if missing:
        raise ValueError(f"tensor stream ended without {len(missing)} tensors, e.g. {missing[:3]}")
    return [[name for name, _, _ in shard] for shard in shards], sum(map(_nbytes, specs))


def write_weight_index(folder: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    """``model.safetensors.index.json``: which file holds each tensor."""
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2))


def write_weight_files(named_tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, stem: str,
                       specs: Sequence[TensorSpec], max_shard_bytes: int = 5 * 1024**3
                       ) -> tuple[dict[str, str], int]:
    """Stream tensors of known specs into ``folder/{stem}-0000i.safetensors`` (one tensor held at a
    time; no index, no rename: for writers that each fill part of one folder). Returns (tensor
    name -> file name, bytes written)."""
    shard_names, total_bytes = _write_streamed(named_tensors, folder, max_shard_bytes,
                                               list(specs), stem=f".{stem}.part")
    weight_map = {}
    for i, names in enumerate(shard_names):
        final = f"{stem}-{i + 1:05d}.safetensors"
        os.replace(folder / f".{stem}.part-{i:05d}.safetensors", folder / final)
        weight_map.update({name: final for name in names})
    return weight_map, total_bytes


def iter_hf_tensors(hf_dir: Union[str, Path], names: Optional[Iterable[str]] = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) lazily, file by file, reading only the requested names."""
    files = hf_weight_files(hf_dir)
    wanted = list(files) if names is None else list(names)
    unknown = [n for n in wanted if n not in files]
    if unknown:
        raise KeyError(f"{hf_dir}: no tensor named {unknown[:3]}")
    by_file: dict[Path, list[str]] = {}
    for n in wanted:
        by_file.setdefault(files[n], []).append(n)
    for path, file_names in by_file.items():
        with safe_open(str(path), "pt") as f:
            for n in file_names:
                yield n, f.get_tensor(n)


@contextlib.contextmanager
def _open_safetensors(path: Path):
    try:
        handle = safe_open(str(path), "pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a complete safetensors file ({e}); the shard is "
                         "truncated or corrupt") from None
    with handle as f:
        yield f


@contextlib.contextmanager
def open_hf_slices(files: dict[str, Path], names: Sequence[str]) -> Iterator[list]:
    """Lazy handles (``safetensors`` slices: ``.get_shape()``, ``[a:b]``, ``[:, a:b]``) on the named
    tensors; only the rows/columns indexed are read. Files are opened for the ``with`` block
    only, so their memory maps (which count as resident memory once read) do not pile up."""
    missing = [n for n in names if n not in files]
    if missing:
        raise KeyError(f"no tensor named {missing[0]!r} in the checkpoint's safetensors files")
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(_open_safetensors(path))
                   for path in dict.fromkeys(files[n] for n in names)}
        yield [handles[files[n]].get_slice(n) for n in names]
