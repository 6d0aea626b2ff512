"""The embedded rollout engine: a transformers model in the trainer's own process.

Batched KV-cache decoding written here (not ``model.generate``) so that sampling is exactly what
the actor recomputes and reproducible per sample:
- sample j of prompt i draws its uniforms from its own generator seeded with
  ``sample_seed(sampling.seed, i, j)``, one per token, so a sample does not depend on which other
  samples share its batch, and re-running a step after a resume gives the same tokens;
- ``logprobs`` are taken from softmax(logits / T) over the full vocabulary before top-p/top-k
  (greedy: T = 1), in fp32, and so are ``entropies`` (of that distribution, at each token);
- top-k / top-p only restrict where the sampled token may land (inverse-CDF sampling over the
  renormalised kept mass).
Prompts are left-padded; each distinct prompt is prefilled once and its cache copied to its n
samples; finished rows leave the batch, so long samples do not keep short ones' compute alive.
The KV cache is bounded (``kv_cache_gb``): a batch takes only as many samples as their longest
possible sequence (prompt + max_new_tokens) fits, and a single sample that cannot fit is an error
naming the settings, before any decoding.

A mixture-of-experts model also records the experts its routers chose for every token of every
sample (prompt and response) in each MoE layer: ``Completion.meta["routing"]`` [layers, length,
k], for routing replay (R3) and the engine-vs-trainer routing metric. A finished sample stays for
one more forward so that its last token is routed too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import random
import re
import time
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

from megatron_entropy.data.dataset import load_tokenizer
from megatron_entropy.models.builder import DTYPES
from megatron_entropy.rollout.base import Completion, NamedTensors, RolloutEngine, SamplingParams
from megatron_entropy.runtime.seeds import sample_seed



# Decoding a small model on the CPU is many small operations, each of which a second OpenMP
# thread costs more to wake (the launcher's OMP_WAIT_POLICY=PASSIVE) than it saves: such a model
# decodes on one thread. Measured (fp32, 16 prompts x 8 samples x 48 tokens, 2 threads PASSIVE
# against 1, 2-core AMD EPYC): 0.83M parameters 0.39-0.45 s against 0.27 s; 12M 1.95 s against
# 2.5 s; 49M 5.1-5.7 s against 7.7-8.0 s.
SMALL_MODEL_PARAMS = 4_000_000

_MOE_GATE = re.compile(r"layers\.(\d+)\.mlp\.gate$")
_HF_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _fused_expert_slot(state: dict, name: str) -> Optional[tuple[str, torch.Tensor]]:
    """Where a per-expert HF tensor (``...mlp.experts.{e}.gate_proj.weight``, the checkpoint
    layout the bridge exports) lives in a transformers model that keeps its experts fused
    (``mlp.experts.gate_up_proj`` [E, 2I, H] = [gate; up] per expert, ``down_proj`` [E, H, I]):
    (fused key, the view to copy into); None for any other name."""
    m = _HF_EXPERT.match(name)
    if m is None or name in state:
        return None
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down_proj":
        key = f"{prefix}.down_proj"
        return (key, state[key][e]) if key in state else None
    key = f"{prefix}.gate_up_proj"
    if key not in state:
        return None
    gate, up = state[key][e].chunk(2, dim=0)
    return key, gate if proj == "gate_proj" else up


class RoutingRecorder:
    """The top-k experts each MoE router of a transformers model chose in its last forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        gates = sorted((int(m.group(1)), module) for name, module in model.named_modules()
                       if (m := _MOE_GATE.search(name)))
        self.layers = [i for i, _ in gates]
        self.topk = int(model.config.num_experts_per_tok) if gates else 0
        self._last: list[Optional[torch.Tensor]] = [None] * len(gates)
        for slot, (_, module) in enumerate(gates):
            module.register_forward_hook(functools.partial(self._capture, slot))

    def _capture(self, slot: int, module, args, output) -> None:
        if isinstance(output, tuple):
            # transformers 5's router: (logits, scores, indices), the indices its experts use.
            indices = output[2]
        else:
            # transformers 4's gate is a Linear; its block takes the top-k of the fp32 softmax.
            indices = torch.softmax(output, dim=-1, dtype=torch.float).topk(self.topk).indices
        self._last[slot] = indices.detach()

    def take(self, rows: int, width: int) -> torch.Tensor:
        """[rows, width, layers, k] int16 (sorted expert ids) of the last forward's tokens."""
        per_layer = [t.view(rows, width, self.topk) for t in self._last]
        self._last = [None] * len(self._last)
        return torch.stack(per_layer, dim=2).sort(dim=-1).values.to(torch.int16).cpu()


def _keep_rows(cache, keep: list[int], *rows: torch.Tensor) -> list[torch.Tensor]:
    """The KV cache and ``rows`` cut down to the batch rows ``keep``."""
    sel = torch.tensor(keep, dtype=torch.long, device=rows[0].device)
    cache.reorder_cache(sel)
    return [t[sel] for t in rows]


def free_memory_bytes(device: torch.device) -> float:
    """Memory free for new tensors: the GPU's, or the host's MemAvailable."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".")[:2] if p.isdigit())


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in (x if isinstance(x, (list, tuple)) else [x])]


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float,
                  top_p: float = 1.0, top_k: int = -1
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse CDF with the given uniforms in [0, 1).

    Returns (tokens [B], logprobs [B], entropies [B]): the log-prob of each token and the entropy
    of softmax(logits / T) over the full vocabulary (T = 1 when greedy, ``temperature == 0``),
    before any truncation.
    """
    logits = logits.float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    probs = logp.exp()
    entropies = -(probs * logp).sum(dim=-1)
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None])[:, 0], entropies
    if top_p < 1.0 or top_k > 0:
        probs, order = probs.sort(dim=-1, descending=True)
        if top_k > 0:
            probs[:, top_k:] = 0
        if top_p < 1.0:
            # Of what top-k kept (renormalised, as vLLM and transformers do), keep the smallest
            # prefix whose mass reaches top_p; the most likely token always stays.
            before = (probs.cumsum(dim=-1) - probs) / probs.sum(dim=-1, keepdim=True)
            probs = probs.masked_fill(before >= top_p, 0)
    else:
        order = None
    cdf = probs.cumsum(dim=-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    pos = torch.searchsorted(cdf, target, right=True)[:, 0]
    # u * total can round up to the total: fall back to the last token with mass.
    last = (probs > 0).cumsum(dim=-1).argmax(dim=-1)
    pos = torch.minimum(pos, last)
    tokens = pos if order is None else order.gather(-1, pos[:, None])[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0], entropies


class InProcessEngine(RolloutEngine):
    """Generation with a transformers model on this process's device; one per DP leader."""

    shared = False

    def __init__(self, hf_dir: Union[str, Path], dtype: str = "fp32", batch_size: int = 64,
                 device: Union[str, torch.device] = "cpu", kv_cache_gb: float = 0.0):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        hf_dir = Path(hf_dir)
        if not (hf_dir / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {str(hf_dir)!r}: the in-process engine "
                                    "needs a Hugging Face model folder")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self._dtype = dtype
        # transformers 4.56 renamed torch_dtype to dtype.
        dtype_kw = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
        self.model = AutoModelForCausalLM.from_pretrained(
            str(hf_dir), local_files_only=True, **{dtype_kw: DTYPES[dtype]}).to(self.device).eval()
        self.tokenizer = load_tokenizer(hf_dir)
        gen = getattr(self.model, "generation_config", None)
        self.eos_ids = set(_as_list(getattr(gen, "eos_token_id", None))
                           + _as_list(self.model.config.eos_token_id)
                           + _as_list(self.tokenizer.eos_token_id))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.one_thread_decode = (self.device.type == "cpu" and sum(
            p.numel() for p in self.model.parameters()) < SMALL_MODEL_PARAMS)
        self.kv_cache_bytes = kv_cache_gb * 2 ** 30 if kv_cache_gb > 0 else \
            0.5 * free_memory_bytes(self.device)
        recorder = RoutingRecorder(self.model)
        self.routing: Optional[RoutingRecorder] = recorder if recorder.layers else None
        self.weight_version = 0
        self._tokens = 0
        self._seconds = 0.0

    # ------------------------------------------------------------------------------- generate

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1, :].float()

    def _new_cache(self):
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            return DynamicCache()

    def _prefill(self, prompts: list[list[int]], rows: list[int]) -> tuple:
        """The distinct prompts' forward (left-padded), its KV cache copied to each sample of
        ``rows``: (cache, last logits, attention mask, next positions, routing pieces) per
        sample."""
        dev = self.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache()
        logits = self._forward(ids, mask, positions, cache)
        # MoE: each sample's routing, [tokens, layers, k] pieces, from its prompt's on.
        routes: list[list[torch.Tensor]] = [[] for _ in rows]
        if self.routing is not None:
            prefill = self.routing.take(len(prompts), width)
            for s, r in enumerate(rows):
                routes[s].append(prefill[r, width - len(prompts[r]):])
        # Copy each distinct prompt's cache to its samples.
        expand = torch.tensor(rows, dtype=torch.long, device=dev)
        cache.reorder_cache(expand)
        next_pos = torch.tensor([len(prompts[r]) for r in rows], dtype=torch.long, device=dev)
        return cache, logits[expand], mask[expand], next_pos, routes

    def _stop_reason(self, tokens: list[int], sp: SamplingParams, stop_ids: set[int],
                     window: int, limit: int) -> tuple[Optional[str], bool]:
        """Why a sample that has just sampled ``tokens[-1]`` ends (None: it goes on; ``limit``:
        its token budget), and whether a stop string ended it (the last ``window`` tokens'
        text holds it)."""
        if tokens[-1] in stop_ids:
            return "stop", False
        if sp.stop and any(stop in self.tokenizer.decode(tokens[-window:],
                                                         skip_special_tokens=True)
                           for stop in sp.stop):
            return "stop", True
        if len(tokens) >= limit:
            return "length", False
        return None, False

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], rows: list[int], seeds: list[int],
                        sp: SamplingParams, limits: list[int]) -> list[Completion]:
        """Decode one sample per entry of ``rows`` (an index into the distinct ``prompts``), of
        at most ``limits`` tokens each."""
        dev = self.device
        cache, logits, mask, next_pos, routes = self._prefill(prompts, rows)
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        stop_ids = self.eos_ids | set(sp.stop_token_ids)
        stop_window = 4 * max((len(s) for s in sp.stop), default=0) + 4  # tokens; a char <= 4 B
        n = len(rows)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        entropies: list[list[float]] = [[] for _ in range(n)]
        reasons: list[Optional[str]] = [None] * n
        stopped_by_text = [False] * n
        active = list(range(n))  # sample index of each row still in the batch
        while True:
            uniforms = torch.stack([torch.rand((), generator=gens[s], dtype=torch.float64)
                                    for s in active])
            tok, lp, ent = sample_tokens(logits, uniforms.to(dev), sp.temperature, sp.top_p,
                                         sp.top_k)
            tok_list, lp_list, ent_list = tok.tolist(), lp.tolist(), ent.tolist()
            keep = []
            for row, s in enumerate(active):
                tokens[s].append(tok_list[row])
                logprobs[s].append(lp_list[row])
                entropies[s].append(ent_list[row])
                reasons[s], stopped_by_text[s] = self._stop_reason(tokens[s], sp, stop_ids,
                                                                   stop_window, limits[s])
                if reasons[s] is None:
                    keep.append(row)
            if self.routing is None:
                if not keep:
                    break
                if len(keep) < len(active):
                    mask, next_pos, tok = _keep_rows(cache, keep, mask, next_pos, tok)
                    active = [active[r] for r in keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = self._forward(tok[:, None], mask, next_pos[:, None], cache)
            next_pos = next_pos + 1
            if self.routing is not None:
                # The rows that just finished had this one more forward to route their last
                # token (no log-prob needs its output); now they leave.
                step = self.routing.take(len(active), 1)
                for row, s in enumerate(active):
                    routes[s].append(step[row])
                if not keep:
                    break
                if len(keep) < len(active):
                    mask, next_pos, logits = _keep_rows(cache, keep, mask, next_pos, logits)
                    active = [active[r] for r in keep]

        out = []
        for s in range(n):
            text = self.tokenizer.decode(tokens[s], skip_special_tokens=True)
            if stopped_by_text[s]:
                text = text[:min((text.find(x) for x in sp.stop if x in text), default=len(text))]
            meta: dict = {"weight_version": self.weight_version}
            if routes[s]:
                meta["routing"] = torch.cat(routes[s]).permute(1, 0, 2).contiguous()
            out.append(Completion(token_ids=tokens[s], logprobs=logprobs[s],
                                  entropies=entropies[s], text=text,
                                  finish_reason=reasons[s], meta=meta))
        return out

    @property
    def logprob_dtype(self) -> str:
        return self._dtype

    def generate(self, prompts: list[list[int]],
                 sampling: SamplingParams) -> list[list[Completion]]:
        if sampling.n < 1 or min((sampling.budget(i) for i in range(len(prompts))),
                                 default=1) < 1:
            raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got n={sampling.n}, "
                             f"max_new_tokens={sampling.max_new_tokens}"
                             + (f" ({sampling.max_new_tokens_per_prompt} per prompt)"
                                if sampling.max_new_tokens_per_prompt else ""))
        if sampling.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {sampling.temperature}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        with self._decode_threads():
            return self._generate(prompts, sampling)

    @contextlib.contextmanager
    def _decode_threads(self) -> Iterator[None]:
        """One intra-op thread for a small model on the CPU (``SMALL_MODEL_PARAMS``), then the
        process's count again."""
        threads = torch.get_num_threads()
        if not self.one_thread_decode or threads == 1:
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token of one sequence: every layer's keys and values."""
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        size = torch.empty((), dtype=self.model.dtype).element_size()
        return 2 * c.num_hidden_layers * kv_heads * head_dim * size

    def batch_rows(self, longest_prompt: int, max_new_tokens: int) -> int:
        """How many samples decode together: ``batch_size``, or fewer where their KV cache at
        full length would pass ``kv_cache_gb``; an error when one sample does not fit."""
        per_sample = self.kv_bytes_per_token * (longest_prompt + max_new_tokens)
        rows = int(self.kv_cache_bytes // per_sample)
        if rows < 1:
            raise ValueError(
                f"the in-process engine's KV cache cannot hold one sequence of "
                f"{longest_prompt} prompt + rollout.max_new_tokens={max_new_tokens} tokens: "
                f"{per_sample / 2 ** 30:.2f} GiB at {self.kv_bytes_per_token} bytes a token, "
                f"against {self.kv_cache_bytes / 2 ** 30:.2f} GiB (rollout.kv_cache_gb; 0 = half "
                "the free memory): raise rollout.kv_cache_gb, lower rollout.max_new_tokens, or "
                "serve the rollouts from vLLM/SGLang (rollout.engine)")
        return min(self.batch_size, rows)

    def _generate(self, prompts: list[list[int]],
                  sampling: SamplingParams) -> list[list[Completion]]:
        start = time.perf_counter()
        base_seed = sampling.seed if sampling.seed is not None else random.getrandbits(62)
        requests = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]
        results: list[list[Optional[Completion]]] = [[None] * sampling.n for _ in prompts]
        rows = self.batch_rows(max((len(p) for p in prompts), default=0), sampling.max_new_tokens)
        for b in range(0, len(requests), rows):
            chunk = requests[b:b + rows]
            distinct = sorted({i for i, _ in chunk})
            where = {i: r for r, i in enumerate(distinct)}
            done = self._generate_batch([list(prompts[i]) for i in distinct],
                                        [where[i] for i, _ in chunk],
                                        [sample_seed(base_seed, i, j) for i, j in chunk], sampling,
                                        [sampling.budget(i) for i, _ in chunk])
            for (i, j), c in zip(chunk, done):
                results[i][j] = c
                self._tokens += len(c.token_ids)
        self._seconds += time.perf_counter() - start
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------------------- weights

    @torch.no_grad()
    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy full HF-named tensors (streamed) into the model in place, as weight version
        ``version``. Every weight must be given (a tied alias counts for both names); an unknown
        name or a wrong shape raises."""
        state = self.model.state_dict()
        needed = {t.data_ptr(): name for name, t in state.items()}
        done: set[int] = set()
        expert_slices: dict[str, int] = {}  # fused expert tensor -> slices written
        for name, tensor in named_tensors:
            fused = _fused_expert_slot(state, name)
            if fused is not None:
                key, dst = fused
                if tuple(tensor.shape) != tuple(dst.shape):
                    raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the rollout model's slice of {key} is {tuple(dst.shape)}")
                dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
                expert_slices[key] = expert_slices.get(key, 0) + 1
                parts = 2 if key.endswith("gate_up_proj") else 1
                if expert_slices[key] == parts * state[key].shape[0]:
                    done.add(state[key].data_ptr())
                continue
            if name not in state:
                raise KeyError(f"load_weights: {name!r} is not a weight of the rollout model "
                               f"(e.g. {', '.join(list(state)[:3])})")
            dst = state[name]
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the "
                                 f"rollout model's is {tuple(dst.shape)}")
            dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
            done.add(dst.data_ptr())
        missing = [name for ptr, name in needed.items() if ptr not in done]
        if missing:
            raise ValueError(f"load_weights: {len(missing)} weights were not sent, e.g. "
                             f"{', '.join(sorted(missing)[:5])}; the rollout model would mix "
                             "old and new weights")
        self.weight_version = version

    def metrics(self) -> dict[str, float]:
        out = {"rollout/response_tokens": float(self._tokens)}
        if self._seconds > 0:
            out["rollout/tokens_per_s"] = self._tokens / self._seconds
        self._tokens, self._seconds = 0, 0.0
        return out
