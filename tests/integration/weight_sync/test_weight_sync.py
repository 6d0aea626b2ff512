"""Weight sync per pipeline stage (megatron_entropy/weight_sync): at PP=2 the disk folder the
stages write together and the tensors the in-process engine receives are, bit for bit, what the
full-gather export (``export_hf_weights``) gives; each stage writes its own parameters' bytes;
buckets keep to their size."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from harness import init_megatron, run_distributed
from tiny_models import save_tiny_hf_model

from megatron_entropy.models.arch import load_arch
from megatron_entropy.weight_sync.base import with_last
from megatron_entropy.weight_sync.stream import plan_buckets, spec_bytes

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart_model"
BUCKET = 60_000  # bytes: several buckets per stage of these models, some tensors bigger


class FolderReader:
    """Stands in for a server's reload endpoint: records the folder's tensors when told."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}
        self.version = None

    def reload_from_folder(self, folder: Path, version: int) -> None:
        from megatron_entropy.models.hf_io import iter_hf_tensors

        self.loaded = {n: t.clone() for n, t in iter_hf_tensors(folder)}
        self.version = version


def _data_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        header = struct.unpack("<Q", f.read(8))[0]
    return path.stat().st_size - 8 - header


def _sync_at_pp2(hf_dir: Path, out: Path) -> dict:
    """Worker (2 ranks, PP=2): perturbed weights, then the full-gather export, the disk sync, the
    in-place sync into a real in-process engine and the bucket relay, all from the same model."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_entropy.models.bridge import export_hf_weights, load_hf_weights
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.models.sharding import layer_offset, to_global_name
    from megatron_entropy.rollout.inprocess import InProcessEngine
    from megatron_entropy.weight_sync import DiskSync, InPlaceSync
    from megatron_entropy.weight_sync.stream import buckets_at_first_stage, model_stage_stream

    init_megatron(pipeline=2)
    arch = load_arch(hf_dir)
    model = build_gpt_model(arch, 1, 2, dtype="fp32", transformer_impl="local", seq_length=64)
    load_hf_weights(model, hf_dir, arch)
    offset = layer_offset(model)
    stage_bytes = 0
    with torch.no_grad():  # new weights, the same whatever the layout (seeded by global name)
        for name, p in model.named_parameters():
            gname = to_global_name(name, offset)
            g = torch.Generator().manual_seed(sum(map(ord, gname)))
            p.add_(0.01 * torch.randn(p.shape, generator=g))
            if gname == "output_layer.weight" and arch.tie_word_embeddings:
                continue  # the first stage exports the tied embedding
            vocab = gname in ("embedding.word_embeddings.weight", "output_layer.weight")
            rows = arch.vocab_size if vocab else p.shape[0]  # padded vocab rows are not sent
            stage_bytes += rows * p[0].numel() * p.element_size()
    stage = ps.get_pipeline_model_parallel_rank()
    first = stage == 0
    reference = [(n, t.clone()) for n, t in export_hf_weights(model, arch) if first]

    reader = FolderReader() if first else None
    disk = DiskSync(reader, out / "sync", hf_dir)
    disk_stats = disk.sync(model, arch, version=3)
    dist.barrier()
    files = sorted(p.name for p in (out / "sync" / "weights-v3").glob("*.safetensors"))
    written = sum(_data_bytes(out / "sync" / "weights-v3" / f) for f in files
                  if f.startswith(f"model-stage{stage:03d}-"))

    engine = InProcessEngine(hf_dir) if first else None
    InPlaceSync(engine, BUCKET).sync(model, arch, version=4)
    relayed = [(s, [(n, t.clone()) for n, t in b])
               for s, b in buckets_at_first_stage(model_stage_stream(model, arch), BUCKET)]
    dist.barrier()
    return {"grad_after": torch.is_grad_enabled(), "stage": stage, "stage_bytes": stage_bytes,
            "written": written, "files": files,
            "reference": reference, "disk_stats": disk_stats,
            "loaded": reader.loaded if first else None,
            "engine": (({n: t.clone() for n, t in engine.model.state_dict().items()},
                        engine.weight_version) if first else None),
            "relayed": relayed, "sync_dir": sorted(p.name for p in (out / "sync").iterdir())}


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("llama_untied")
    save_tiny_hf_model("llama", d, seed=3, vocab_size=321, num_hidden_layers=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QUICKSTART / name, d / name)
    return d


@pytest.mark.parametrize("model", ["tied", "untied"])
def test_per_stage_sync_at_pp2_equals_the_full_gather(model, untied, tmp_path):
    hf_dir = QUICKSTART if model == "tied" else untied
    arch = load_arch(hf_dir)
    assert arch.tie_word_embeddings == (model == "tied")
    results = run_distributed(_sync_at_pp2, 2, hf_dir, tmp_path, timeout=300)
    first, second = results
    # The syncs leave autograd as they found it (a stream stopped after its last tensor once
    # left it off on the engine's rank: the next step's update then diverged from the others').
    assert first["grad_after"] and second["grad_after"]
    reference = dict(first["reference"])
    assert len(reference) == len(first["reference"])  # every name once (a tied head too)
    # Disk: the folder the two stages wrote holds the full-gather tensors, bit for bit, and
    # nothing else; each stage wrote its own file(s) and exactly its parameters' bytes.
    loaded = first["loaded"]
    assert sorted(loaded) == sorted(reference)
    for name, t in reference.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    for r in results:
        assert any(f.startswith(f"model-stage{r['stage']:03d}-") for f in r["files"])
        assert r["written"] == r["stage_bytes"] > 0
    index = json.loads((tmp_path / "sync" / "weights-v3" / "model.safetensors.index.json")
                       .read_text())
    assert set(index["weight_map"]) == set(reference)
    assert first["disk_stats"]["weight_sync/bytes"] == sum(r["stage_bytes"] for r in results)
    assert second["disk_stats"] == {}
    assert first["sync_dir"] == ["weights-v3"]  # no partial folder left behind
    # In place: the in-process engine (from the original HF weights) now holds the new ones.
    state, version = first["engine"]
    assert version == 4
    for name, t in state.items():
        want = reference["model.embed_tokens.weight" if name == "lm_head.weight"
                         and arch.tie_word_embeddings else name]
        assert torch.equal(t, want), name
    # The relay: every stage's buckets in stage order, the full-gather stream cut into buckets
    # of at most BUCKET bytes (a tensor bigger than that alone), only on the first stage.
    assert second["relayed"] == []
    stages = [s for s, _ in first["relayed"]]
    assert stages == sorted(stages) and set(stages) == {0, 1}
    flat = [(n, t) for _, b in first["relayed"] for n, t in b]
    assert [n for n, _ in flat] == [n for n, _ in first["reference"]]
    assert all(torch.equal(t, reference[n]) for n, t in flat)
    sizes = [[t.numel() * t.element_size() for _, t in b] for _, b in first["relayed"]]
    assert all(sum(s) <= BUCKET or len(s) == 1 for s in sizes)
    assert any(len(s) > 1 for s in sizes) and any(s[0] > BUCKET for s in sizes)


def test_bucket_plan():
    specs = [(f"t{i}", (n,), torch.float32) for i, n in enumerate([10, 10, 30, 5, 5, 1])]
    plan = plan_buckets(specs, bucket_bytes=80)
    # 40 + 40 bytes fill one; 120 alone (bigger than the limit); 20 + 20 + 4
    assert [[n for n, _, _ in b] for b in plan] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert all(sum(map(spec_bytes, b)) <= 80 or len(b) == 1 for b in plan)
    assert plan_buckets(specs, bucket_bytes=1) == [[s] for s in specs]
    assert plan_buckets([], bucket_bytes=80) == []
    assert list(with_last(iter("abc"))) == [("a", False), ("b", False), ("c", True)]
