"""A strict stand-in for an SGLang 0.5.x server, for tests on machines where SGLang cannot run.

It serves a Qwen2 (or Qwen3-MoE) checkpoint in fp32 (the forward of transformers' model written out
over the checkpoint's tensors, ``PlainQwen2``: importing transformers was ~4 of the ~6 CPU seconds
of every server start, and the suite starts ~30) so that generation, log-probs and weight updates
can be checked against a transformers reference, and it enforces SGLang's HTTP contract as its
source states it
(0.5.2 ... 0.5.23, `sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`,
`api/v1/api_types.py`, `sampling/sampling_params.py`):
- ``/generate``: exactly one of ``text``/``input_ids``; ``sampling_params`` keys outside SGLang's
  SamplingParams are answered with HTTP 500 and the plain-text body "Internal Server Error" (as
  a real 0.5.15 server does: SamplingParams raises ``TypeError: Unexpected keyword argument``;
  ``sampling_seed`` exists from 0.5.3 on); values are checked as ``SamplingParams.verify`` does
  (HTTP 400); an input id outside the vocabulary crashes the server (the real scheduler dies
  on it and the whole server exits); top-level keys SGLang does not know are ignored, as its
  GenerateRequest does. The answer is {text, output_ids, meta_info{id, finish_reason{type,
  matched|length|message, status_code, err_type}, prompt_tokens, weight_version,
  total_retractions, input_token_logprobs ([] with logprob_start_len -1), output_token_logprobs
  [[logprob, id, null], ...], output_token_logprobs_length, completion_tokens, cached_tokens,
  e2e_latency}} (SGLang's tokenizer manager's fields, in its order); a list for a batch or
  n > 1. Log-probs are log-softmax(logits / temperature) before top-k/top-p (greedy:
  temperature 1), SGLang's default.
- Weight updates: ``/update_weights_from_disk`` {model_path, ...}, ``/init_weights_update_group``
  {master_address, master_port, rank_offset, world_size, group_name, backend} (joins a real
  process group), ``/update_weights_from_distributed`` {names, dtypes, shapes, group_name, ...}
  (receives one ``broadcast(src=0)`` per tensor), ``/destroy_weights_update_group``; a missing
  required field is HTTP 422 as FastAPI answers it; a failed update is HTTP 400 {success: false}.
- ``/pause_generation`` {mode} (default ``abort``; another mode is a 400 validation error): new
  requests wait; in-flight ones are held at their next token (``in_place``; ``retract`` also
  drops their KV cache, recomputed at continue) or answered at once with finish reason
  ``abort`` and what they had (``abort``). ``/continue_generation``; ``/flush_cache`` is 400
  "Flush cache failed." while requests run or wait (also paused ones: the same answer as the
  idle race below); ``/abort_request`` {rid, abort_all} (SGLang
  0.5.x, the ``rid`` a ``/generate`` body set, matched by prefix as SGLang's scheduler does):
  a request still waiting is answered at once with no tokens, except while the server is
  paused ``in_place``, when it is not aborted at all and runs whole after continue (as a real
  0.5.15 server); a running one after one more decode step (SGLang sets ``to_finish``, which
  wins over EOS); both with finish reason ``abort`` (message "Aborted") and what they had
  (ids, log-probs, weight version); an unknown rid is a no-op; the answer is HTTP 200 with an
  empty body;
  ``/health``, ``/health_generate``, ``/get_model_info`` and ``/model_info`` (with the
  weight version; ``/weight_version`` is 404, as on 0.5.15), ``/get_server_info`` (with the LoRA
  server args).
- LoRA serving (``--enable-lora`` with ``--max-lora-rank``, ``--lora-target-modules`` (names or
  ``all``), ``--max-loras-per-batch``, ``--max-loaded-loras``, ``--lora-paths NAME=PATH``; without
  initial adapters both the rank and the modules must be given, as SGLang's server args check):
  ``/load_lora_adapter`` {lora_name, lora_path} loads a PEFT folder (adapter_config.json,
  adapter_model.safetensors) and answers {success, error_message, loaded_adapters}, 400 when it
  fails: LoRA not enabled, a name that is loaded ("... because it is already loaded"), a rank
  above --max-lora-rank or modules outside --lora-target-modules (both "incompatible with the
  current LoRA memory pool configuration"; modules compared as SGLang normalises them: q/k/v ->
  qkv_proj, gate/up -> gate_up_proj), DoRA; more than --max-loaded-loras loaded evicts the least
  recently used. ``/unload_lora_adapter`` {lora_name}: 400 for a name not loaded; new requests
  naming it are refused at once, and it is dropped once the requests using it finished.
  ``/generate`` with ``lora_path`` (a loaded adapter's name, one per prompt or one for all):
  each linear module the adapter targets adds (alpha / r) B A x to its output (rsLoRA: alpha /
  sqrt(r)), as SGLang's LoRA layers do beside the base GEMM; a name not loaded is HTTP 400
  {error: {message: "The following requested LoRA adapters are not loaded: ..."}} (SGLang's
  LoRARegistry.acquire); without --enable-lora the key is ignored, as SGLang ignores it.
  ``/update_weight_version`` {new_version}: the version later answers carry.
- SIGTERM ends it (aiohttp's graceful exit), as a real 0.5.15 CPU server drains and exits
  within ~7 s of one, also after batched requests.
Test knobs (not SGLang's): ``--token-delay-s`` slows decoding; ``--request-log`` appends every
request body to a JSONL file; ``--busy-health-delay-s`` makes ``/health`` answer that late while a
request runs and ``--warmup-s`` holds the first request that long before decoding (a busy server,
and one warming up, that still make progress); ``--exit-after PATH`` makes the server exit
(code 1, as if killed) once it has answered its first request to PATH (a server that dies right
after a client first spoke to it). Endpoints under ``/fake/`` set faults at run time:
``/fake/corrupt_syncs`` {noise}: later weight updates answer success but add Gaussian noise of
that std to every weight (a silently wrong sync); ``/fake/die_on_next_sync``: the next
``/update_weights_from_disk`` kills the process mid-call (as SGLang's scheduler dying on it);
``/fake/abort_next`` {count}: that many next requests come back aborted after one token;
``/fake/flush_fails`` {count}: that many next ``/flush_cache`` calls on an idle server
answer 400 "Flush cache failed." (a real server did once, right after a request returned);
``/fake/update_delay`` {seconds}: ``/update_weights_from_disk`` answers that much later (a
large model's reload takes minutes); ``/fake/perturb`` {scale, seed, after_requests}: every
tensor of the weights loaded last gets Gaussian noise of scale x its own std (a wrong copy of
the model; scale 0 restores it), at once or once that many more ``/generate`` requests were
answered (weights changed behind a client's back between two of its calls, as another client
of a shared server loading others would) (``--sync-noise`` sets the noise from the start);
``GET /fake/state``: requests running and waiting, tokens decoded.

Run: python tests/helpers/fake_sglang_server.py --model-path DIR --host 127.0.0.1 --port P
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from aiohttp import web
from safetensors.torch import load_file
from tokenizers import Tokenizer

SAMPLING_KEYS_0_5_2 = (
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias")
SAMPLING_KEYS_NEW = ("stop_regex", "sampling_seed")  # 0.5.3+
PAUSE_MODES = ("abort", "retract", "in_place")
# SGLang's LoRA module names as its memory pool keeps them (lora/utils.py
# get_normalized_target_modules): q/k/v share qkv_proj, gate/up share gate_up_proj.
LORA_POOL_NAMES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                   "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."
# SGLang's FINISH_ABORT().to_json(): every abort answer (abort request, pause mode abort).
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}

# SGLang's answer to a LoRA endpoint on a server started without --enable-lora.
LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class BadRequest(Exception):
    pass


class UnknownSamplingKey(Exception):
    """SGLang 0.5.15 turns this into HTTP 500 (a TypeError in SamplingParams)."""


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in text.split(".")[:3])


def missing_fields(body: Any, required: tuple[str, ...]) -> Optional[web.Response]:
    """FastAPI's 422 for a body that is not an object or lacks required fields."""
    if not isinstance(body, dict):
        return web.json_response({"detail": [{"type": "model_attributes_type", "loc": ["body"],
                                              "msg": "Input should be a valid dictionary"}]},
                                 status=422)
    missing = [k for k in required if k not in body]
    if missing:
        return web.json_response({"detail": [{"type": "missing", "loc": ["body", k],
                                              "msg": "Field required"} for k in missing]},
                                 status=422)
    return None


class PlainQwen2:
    """Qwen2ForCausalLM's forward in fp32, as transformers computes it (RMSNorm in fp32, rotary
    embeddings from ``rope_theta``, grouped-query SDPA attention with q/k/v biases, SwiGLU), over
    the checkpoint's tensors kept by their HF names (the names weight updates use), with a KV
    cache. The tests hold its log-probs to a transformers reference."""

    def __init__(self, folder: str):
        cfg = json.loads((Path(folder) / "config.json").read_text())
        if cfg.get("model_type") not in ("qwen2", "qwen3_moe"):
            raise SystemExit(f"the fake SGLang server serves Qwen2 and Qwen3-MoE checkpoints, "
                             f"not {cfg.get('model_type')!r} ({folder}/config.json)")
        # Qwen3-MoE: QK-norm per head and a top-k routed SwiGLU MoE block in every layer
        # (Qwen3MoeSparseMoeBlock: softmax in fp32, top-k, optionally renormalised).
        self.moe = cfg["model_type"] == "qwen3_moe"
        self.topk = cfg.get("num_experts_per_tok", 0)
        self.norm_topk = bool(cfg.get("norm_topk_prob", False))
        self.vocab_size = cfg["vocab_size"]
        self.context_len = cfg["max_position_embeddings"]
        self.eos_token_id = cfg.get("eos_token_id")
        self.layers = cfg["num_hidden_layers"]
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps = cfg["rms_norm_eps"]
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta",
                                                                               10000.0))
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64)
                                        .float() / self.head_dim)
        files = sorted(Path(folder).glob("*.safetensors"))
        self.params = {k: v.float() for f in files for k, v in load_file(str(f)).items()}
        # Tied embeddings: the head is the embedding (one tensor, as transformers shares it).
        self.head = self.params.get("lm_head.weight", self.params["model.embed_tokens.weight"])
        # The adapter of the forward running now: module -> (A [r, in], B [out, r], scale).
        self.lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.params[name] * x

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = F.linear(x, self.params[name + ".weight"], self.params.get(name + ".bias"))
        if name in self.lora:  # beside the base GEMM, as SGLang's LoRA layers add it
            a, b, scale = self.lora[name]
            out = out + scale * F.linear(F.linear(x, a), b)
        return out

    def _mlp(self, h: torch.Tensor, pre: str) -> torch.Tensor:
        return self._linear(F.silu(self._linear(h, pre + "gate_proj"))
                            * self._linear(h, pre + "up_proj"), pre + "down_proj")

    def _moe(self, h: torch.Tensor, pre: str) -> torch.Tensor:
        probs = F.softmax(self._linear(h, pre + "gate"), dim=-1, dtype=torch.float)
        weights, experts = probs.topk(self.topk, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for j in range(self.topk):
            for e in experts[..., j].unique().tolist():
                rows = experts[..., j] == e
                out[rows] += weights[..., j][rows, None] * self._mlp(h[rows], f"{pre}experts.{e}.")
        return out

    def __call__(self, ids: torch.Tensor, cache: Optional[list], lora: Optional[dict] = None
                 ) -> tuple[torch.Tensor, list]:
        """The last position's logits [V] for ``ids`` [1, T] after ``cache`` (None: none),
        and the cache extended by them, with the LoRA adapter ``lora`` (module -> A, B, scale;
        None: the base)."""
        self.lora = lora or {}
        past = 0 if cache is None else cache[0][0].shape[2]
        cache = cache or [None] * self.layers
        t = ids.shape[1]
        freqs = torch.outer(torch.arange(past, past + t, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos(), emb.sin()

        def rotary(x: torch.Tensor) -> torch.Tensor:  # x [1, heads, T, head_dim]
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
            return x * cos + rotated * sin

        x = self.params["model.embed_tokens.weight"][ids]
        for i in range(self.layers):
            pre = f"model.layers.{i}."
            h = self._norm(x, pre + "input_layernorm.weight")
            q, k, v = (self._linear(h, pre + f"self_attn.{n}_proj").view(1, t, -1, self.head_dim)
                       .transpose(1, 2) for n in "qkv")
            if self.moe:
                q = self._norm(q, pre + "self_attn.q_norm.weight")
                k = self._norm(k, pre + "self_attn.k_norm.weight")
            q, k = rotary(q), rotary(k)
            if cache[i] is not None:
                k, v = torch.cat((cache[i][0], k), 2), torch.cat((cache[i][1], v), 2)
            cache[i] = (k, v)
            group = self.heads // self.kv_heads
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                               v.repeat_interleave(group, 1),
                                               is_causal=past == 0 and t > 1)
            x = x + self._linear(a.transpose(1, 2).reshape(1, t, -1), pre + "self_attn.o_proj")
            h = self._norm(x, pre + "post_attention_layernorm.weight")
            x = x + (self._moe(h, pre + "mlp.") if self.moe else self._mlp(h, pre + "mlp."))
        x = self._norm(x[:, -1], "model.norm.weight")
        return F.linear(x, self.head)[0], cache


def pool_names(modules: Any) -> set[str]:
    """Target modules as SGLang's LoRA memory pool names them (``all``: every one)."""
    if modules == "all" or modules == ["all"]:
        modules = LORA_MODULES
    return {LORA_POOL_NAMES.get(m.split(".")[-1], m.split(".")[-1]) for m in modules}


class Adapter:
    """A PEFT LoRA adapter folder as SGLang's LoRAConfig and LoRAAdapter read it: r, lora_alpha,
    target_modules, use_rslora/use_dora from adapter_config.json; lora_A/lora_B per module from
    adapter_model.safetensors."""

    def __init__(self, path: str, model: PlainQwen2):
        folder = Path(path)
        config_file = folder / "adapter_config.json"
        if not config_file.is_file():  # LoRAConfig reads it first
            raise ValueError(f"Can't find 'adapter_config.json' at '{path}'")
        cfg = json.loads(config_file.read_text())
        self.path, self.r, self.targets = path, int(cfg["r"]), cfg["target_modules"]
        self.dora = bool(cfg.get("use_dora"))
        alpha = float(cfg["lora_alpha"])
        scale = alpha / self.r ** 0.5 if cfg.get("use_rslora") else alpha / self.r
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            base = model.params.get(module + ".weight")
            if base is None or a.shape != (self.r, base.shape[1]) \
                    or b.shape != (base.shape[0], self.r):
                raise ValueError(f"{key}: no module of the base model takes an adapter of shapes "
                                 f"{tuple(a.shape)} and {tuple(b.shape)}")
            self.weights[module] = (a.float(), b.float(), scale)


class RequestState:
    """One /generate request: its rid and whether /abort_request asked it to stop."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.started = False  # left the waiting queue
        self.retractions = 0
        self.aborted = threading.Event()  # read by the decoding thread
        self.aborted_async = asyncio.Event()  # wakes it while it waits to start

    def abort(self) -> None:
        self.aborted.set()
        self.aborted_async.set()


class FakeSGLang:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.model_path = args.model_path
        self.model = PlainQwen2(args.model_path)
        tokenizer = Path(args.model_path) / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tokenizer)) if tokenizer.is_file() else None
        self.vocab_size = self.model.vocab_size
        self.context_len = self.model.context_len
        self.weight_version = args.weight_version
        self.version = args.version
        self.sampling_keys = SAMPLING_KEYS_0_5_2 + (
            SAMPLING_KEYS_NEW if version_tuple(args.version) >= (0, 5, 3) else ())
        self.groups: dict[str, Any] = {}
        self.compute = threading.Lock()  # one forward at a time; weight loads wait for it
        self.unpaused = asyncio.Event()  # new requests wait on it
        self.unpaused.set()
        self.decoding = threading.Event()  # in-flight requests wait on it
        self.decoding.set()
        self.pause_mode: Optional[str] = None
        self.aborts = 0  # pauses in abort mode so far: a request started before one is cut off
        self.running = 0
        self.waiting = 0
        self.warmed_up = False
        self.sync_noise = args.sync_noise
        self.decoded = 0  # tokens decoded since start
        self.die_on_sync = False
        self.abort_next = 0
        self.requests: dict[str, RequestState] = {}  # by rid, while they wait or run
        # LoRA serving: loaded adapters by name, least recently used first; requests using each.
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()
        self.adapter_users: dict[str, int] = {}
        args.enable_lora = args.enable_lora or bool(args.lora_paths)  # as SGLang sets it
        self.lora_rank = args.max_lora_rank
        self.lora_modules = args.lora_target_modules
        if args.enable_lora and not args.lora_paths and not (self.lora_rank
                                                             and self.lora_modules):
            raise SystemExit("When no initial --lora-paths is provided, you need to specify both "
                             "--max-lora-rank and --lora-target-modules for LoRA "
                             "initialization.")
        if args.max_loaded_loras is not None and args.max_loaded_loras < \
                args.max_loras_per_batch:
            raise SystemExit("max_loaded_loras should be greater than or equal to "
                             "max_loras_per_batch.")
        initial = [Adapter(p.split("=", 1)[-1], self.model) for p in args.lora_paths]
        # Inferred from the initial adapters where not given (SGLang's LoRAManager).
        self.lora_rank = self.lora_rank or max((a.r for a in initial), default=0)
        self.lora_modules = self.lora_modules or sorted(
            {m for a in initial for m in a.targets})
        for spec, adapter in zip(args.lora_paths, initial):
            name = spec.split("=", 1)[0] if "=" in spec else spec
            error = self.admit(name, adapter)
            if error:
                raise SystemExit(error)
        self.unperturbed: Optional[dict[str, torch.Tensor]] = None  # before /fake/perturb
        # /fake/perturb with after_requests: (answers still to send, scale, seed).
        self.perturb_later: Optional[tuple[int, float, int]] = None
        self.flush_fails = 0  # idle /flush_cache calls still to answer 400 (/fake/flush_fails)
        self.update_delay = 0.0  # seconds /update_weights_from_disk takes (/fake/update_delay)

    # --------------------------------------------------------------------------- helpers

    def admit(self, name: str, adapter: Adapter) -> str:
        """Register ``adapter`` as ``name`` (SGLang's LoRAManager.validate_new_adapter, then
        the registry's LRU eviction past --max-loaded-loras); the error, or ""."""
        if name in self.adapters:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        if adapter.dora:
            return (f"Failed to load {name} because LoRA serving currently doesn't support "
                    "DoRA adapters")
        if adapter.r > self.lora_rank or not pool_names(adapter.targets) <= pool_names(
                self.lora_modules):
            return (f"LoRA adapter {name} with rank {adapter.r} is incompatible with the "
                    "current LoRA memory pool configuration. Please ensure that the LoRA "
                    "adapter's rank is within the configured `--max-lora-rank` and that the "
                    "target modules are included in `--lora-target-modules`.")
        self.adapters[name] = adapter
        self.adapter_users.setdefault(name, 0)
        limit = self.args.max_loaded_loras
        while limit is not None and len(self.adapters) > limit:
            evicted, _ = self.adapters.popitem(last=False)
            print(f"Unloading least recently used LoRA adapter '{evicted}'", flush=True)
        return ""

    def loaded_adapters(self) -> dict[str, str]:
        return {name: a.path for name, a in self.adapters.items()}

    def log_request(self, path: str, body: Any) -> None:
        if self.args.request_log:
            with open(self.args.request_log, "a") as f:
                f.write(json.dumps({"path": path, "body": body}) + "\n")

    def check_sampling(self, sp: Any) -> dict:
        if sp is None:
            return {}
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params: invalid type, expected a map")
        for key in sp:
            if key not in self.sampling_keys:
                raise UnknownSamplingKey(f"Unexpected keyword argument '{key}'")

        def typed(key: str, kinds: tuple, what: str) -> None:
            value = sp.get(key)
            if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)
                                      and bool not in kinds):
                raise BadRequest(f"sampling_params.{key}: invalid type: {value!r}, expected {what}")

        for key in ("max_new_tokens", "top_k", "n", "min_new_tokens", "sampling_seed",
                    "stream_interval"):
            typed(key, (int,), "an integer")
        for key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                    "repetition_penalty"):
            typed(key, (int, float), "a number")
        for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                    "no_stop_trim"):
            typed(key, (bool,), "a boolean")
        stop = sp.get("stop")
        if stop is not None and not (isinstance(stop, str) or isinstance(stop, list) and all(
                isinstance(s, str) for s in stop)):
            raise BadRequest(f"sampling_params.stop: invalid type: {stop!r}")
        ids = sp.get("stop_token_ids")
        if ids is not None and not (isinstance(ids, list) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise BadRequest(f"sampling_params.stop_token_ids: invalid type: {ids!r}")
        p = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
             "n": 1, "ignore_eos": False, "no_stop_trim": False, "skip_special_tokens": True,
             "stop": [], "stop_token_ids": [], "sampling_seed": None,
             **{k: v for k, v in sp.items() if v is not None}}
        if isinstance(p["stop"], str):
            p["stop"] = [p["stop"]]
        # SamplingParams.verify
        if p["temperature"] < 0:
            raise BadRequest(f"temperature must be a non-negative finite number, got "
                             f"{p['temperature']}.")
        if not 0.0 < p["top_p"] <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {p['top_p']}.")
        if not 0.0 <= p["min_p"] <= 1.0:
            raise BadRequest(f"min_p must be in [0, 1], got {p['min_p']}.")
        if p["top_k"] < 1 and p["top_k"] != -1:
            raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {p['top_k']}.")
        if p["max_new_tokens"] < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {p['max_new_tokens']}.")
        if p["n"] < 1:
            raise BadRequest(f"n must be at least 1, got {p['n']}.")
        return p

    def check_input_ids(self, ids: Any) -> list[list[int]]:
        batch = ids if ids and isinstance(ids[0], list) else [ids]
        for row in batch:
            if not isinstance(row, list) or not row or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in row):
                raise BadRequest("input_ids: invalid type, expected a list of token ids or a "
                                 "list of such lists")
            bad = [t for t in row if not 0 <= t < self.vocab_size]
            if bad:  # SGLang's scheduler crashes on the embedding lookup; the server exits
                print(f"IndexError: index {bad[0]} is out of bounds for dimension 0 with size "
                      f"{self.vocab_size}", flush=True)
                os._exit(1)
            if len(row) >= self.context_len:
                raise BadRequest(f"The input ({len(row)} tokens) is longer than the model's "
                                 f"context length ({self.context_len} tokens).")
        return batch

    # ------------------------------------------------------------------------ generation

    def sample_one(self, prompt: list[int], p: dict, want_logprobs: bool,
                   state: RequestState, logprob_start: int = -1,
                   lora: Optional[dict] = None) -> dict:
        t0 = time.time()
        generator = None
        if p["sampling_seed"] is not None:
            generator = torch.Generator().manual_seed(p["sampling_seed"])
        greedy = p["temperature"] < 1e-6
        stops = set(p["stop_token_ids"])
        if not p["ignore_eos"] and self.model.eos_token_id is not None:
            eos = self.model.eos_token_id
            stops |= set(eos if isinstance(eos, list) else [eos])
        max_new = min(p["max_new_tokens"], self.context_len - len(prompt))
        out_ids: list[int] = []
        logprobs: list[float] = []
        finish: dict = {"type": "length", "length": max_new}
        past = None
        inputs = torch.tensor([prompt])
        abort = self.abort_next > 0
        self.abort_next -= abort
        aborts_before = self.aborts
        with torch.no_grad():
            for _ in range(max_new):
                if self.aborts != aborts_before:
                    finish = dict(ABORTED)
                    break
                if not self.decoding.is_set():
                    retract = self.pause_mode == "retract"
                    self.decoding.wait()
                    if retract and out_ids:  # its KV was dropped: recompute it
                        past, inputs = None, torch.tensor([prompt + out_ids])
                        state.retractions += 1
                with self.compute:
                    logits, past = self.model(inputs, past, lora)
                if greedy:
                    lp = torch.log_softmax(logits, -1)
                    token = int(torch.argmax(logits))
                else:
                    lp = torch.log_softmax(logits / p["temperature"], -1)
                    probs = lp.exp()
                    if p["top_k"] > 0:
                        kth = torch.topk(probs, min(p["top_k"], probs.numel())).values[-1]
                        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
                    if p["top_p"] < 1.0:
                        sorted_p, order = probs.sort(descending=True)
                        cut = (sorted_p.cumsum(0) - sorted_p) > p["top_p"] * sorted_p.sum()
                        probs[order[cut]] = 0.0
                    token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
                out_ids.append(token)
                self.decoded += 1
                logprobs.append(float(lp[token]))
                inputs = torch.tensor([[token]])
                if abort or state.aborted.is_set():
                    finish = dict(ABORTED)
                    break
                if self.args.token_delay_s:
                    time.sleep(self.args.token_delay_s)
                if token in stops:
                    finish = {"type": "stop", "matched": token}
                    break
                if p["stop"] and self.tokenizer is not None:
                    text = self.tokenizer.decode(out_ids, skip_special_tokens=False)
                    hit = next((s for s in p["stop"] if s in text), None)
                    if hit is not None:
                        finish = {"type": "stop", "matched": hit}
                        break
        text = self.tokenizer.decode(out_ids, skip_special_tokens=p["skip_special_tokens"]) \
            if self.tokenizer is not None else ""
        if finish["type"] == "stop" and isinstance(finish["matched"], str) \
                and not p["no_stop_trim"]:
            text = text[:text.find(finish["matched"])]
        return {"text": text, "output_ids": out_ids, "meta_info": self.meta(
            state, finish, len(prompt), out_ids, logprobs if want_logprobs else None,
            logprob_start, prompt, time.time() - t0)}

    def meta(self, state: RequestState, finish: dict, prompt_tokens: int, out_ids: list[int],
             logprobs: Optional[list[float]], logprob_start: int, prompt: list[int],
             latency: float) -> dict:
        """meta_info as SGLang's tokenizer manager builds it, in its order. With
        logprob_start_len -1 (only the output's) input_token_logprobs is []."""
        meta = {"id": state.rid, "finish_reason": finish, "prompt_tokens": prompt_tokens,
                "weight_version": self.weight_version,
                "total_retractions": state.retractions}
        if logprobs is not None:
            meta["input_token_logprobs"] = ([] if logprob_start < 0 else
                                            [[None, t, None] for t in prompt[logprob_start:]])
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, out_ids)]
            meta["output_token_logprobs_length"] = len(out_ids)
        meta.update({"completion_tokens": len(out_ids), "cached_tokens": 0,
                     "e2e_latency": latency})
        return meta

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return web.json_response({"error": {"message": f"invalid JSON: {e}"}}, status=400)
        self.log_request("/generate", body)
        try:
            if not isinstance(body, dict):
                raise BadRequest("invalid type: expected a map")
            given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
            if not given:
                raise BadRequest("Either text, input_ids or input_embeds should be provided.")
            if len(given) > 1:
                raise BadRequest("Only one of text, input_ids, or input_embeds should be "
                                 "provided.")
            if "text" in given:
                if self.tokenizer is None:
                    raise BadRequest("text input needs a tokenizer")
                texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
                batch = [self.tokenizer.encode(t).ids for t in texts]
                single = not isinstance(body["text"], list)
            else:
                batch = self.check_input_ids(body["input_ids"])
                single = not isinstance(body["input_ids"][0], list)
            if body.get("stream"):
                raise BadRequest("this fake does not stream")
            rl = body.get("return_logprob", False)
            if not isinstance(rl, bool):
                raise BadRequest(f"return_logprob: invalid type: {rl!r}, expected a boolean")
            start = body.get("logprob_start_len", -1)
            if not isinstance(start, int) or isinstance(start, bool):
                raise BadRequest(f"logprob_start_len: invalid type: {start!r}")
            p = self.check_sampling(body.get("sampling_params"))
            names = self.lora_names(body.get("lora_path"), len(batch))
        except BadRequest as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)
        except UnknownSamplingKey as e:
            print(f"TypeError: {e}", flush=True)  # the real server logs it; the client sees:
            return web.Response(text="Internal Server Error", status=500)
        rid = body.get("rid")
        state = RequestState(rid if isinstance(rid, str) else uuid.uuid4().hex)
        self.requests[state.rid] = state
        # Each prompt's adapter weights, held from here (an unload waits for this request).
        loras = [self.adapters[n].weights if n is not None else None for n in names]
        for name in names:
            if name is not None:
                self.adapter_users[name] += 1
        try:
            self.waiting += 1
            try:
                started = asyncio.ensure_future(self.unpaused.wait())
                aborted = asyncio.ensure_future(state.aborted_async.wait())
                await asyncio.wait({started, aborted}, return_when=asyncio.FIRST_COMPLETED)
                started.cancel()
                aborted.cancel()
            finally:
                self.waiting -= 1
            if state.aborted.is_set():
                out = {"text": "", "output_ids": [], "meta_info": self.meta(
                    state, dict(ABORTED), len(batch[0]), [], [] if rl else None, start,
                    batch[0], 0.0)}
                return web.json_response(out if single and p["n"] == 1 else [out])
            state.started = True
            self.running += 1
            try:
                if not self.warmed_up:
                    await asyncio.sleep(self.args.warmup_s)
                    self.warmed_up = True
                loop = asyncio.get_running_loop()
                outs = []
                for prompt, lora in zip(batch, loras):
                    for _ in range(p["n"]):
                        outs.append(await loop.run_in_executor(None, self.sample_one, prompt, p,
                                                               rl, state, start, lora))
            finally:
                self.running -= 1
            if self.perturb_later is not None:
                left, scale, seed = self.perturb_later
                self.perturb_later = (left - 1, scale, seed) if left > 1 else None
                if left <= 1:  # before this answer leaves: the next request meets the new copy
                    await loop.run_in_executor(None, self.perturb, scale, seed)
        finally:
            self.requests.pop(state.rid, None)
            for name in names:
                if name is not None:
                    self.adapter_users[name] -= 1
        return web.json_response(outs[0] if single and p["n"] == 1 else outs)

    def lora_names(self, lora_path: Any, prompts: int) -> list[Optional[str]]:
        """The adapter of each prompt: ``lora_path`` names loaded adapters (one for all, or one
        per prompt), each then the most recently used; without --enable-lora it is ignored."""
        if lora_path is None or not self.args.enable_lora:
            return [None] * prompts
        names = lora_path if isinstance(lora_path, list) else [lora_path] * prompts
        if len(names) != prompts or not all(n is None or isinstance(n, str) for n in names):
            raise BadRequest(f"lora_path: invalid value {lora_path!r} for {prompts} prompts")
        missing = [n for n in names if n is not None and n not in self.adapters]
        if missing:
            raise BadRequest(f"The following requested LoRA adapters are not loaded: "
                             f"{missing[0]}\nLoaded adapters: {self.adapters.keys()}.")
        for n in names:
            if n is not None:
                self.adapters.move_to_end(n)
        return names

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.log_request("/abort_request", body)
        bad = missing_fields(body, ())
        if bad is not None:
            return bad
        rid = body.get("rid")
        for state in list(self.requests.values()):
            # SGLang matches by prefix (rid "x-1" also aborts "x-10"); a request waiting while
            # the server is paused in place is not aborted at all (it runs whole after
            # /continue_generation).
            if not (body.get("abort_all") or isinstance(rid, str) and state.rid.startswith(rid)):
                continue
            if self.pause_mode == "in_place" and not state.started:
                continue
            state.abort()
        return web.Response(status=200)

    # ---------------------------------------------------------------------- weight updates

    def load_named(self, named: list[tuple[str, torch.Tensor]]) -> tuple[bool, str]:
        params = self.model.params
        for name, t in named:
            if name not in params:
                return False, f"Failed to update weights: no parameter named {name}."
            if tuple(params[name].shape) != tuple(t.shape):
                return False, (f"Failed to update weights: {name} has shape "
                               f"{tuple(params[name].shape)}, got {tuple(t.shape)}.")
        self.unperturbed = None  # /fake/perturb perturbs these from now on
        with self.compute, torch.no_grad():
            for name, t in named:
                params[name].copy_(t.to(params[name].dtype))
                if self.sync_noise:  # a silently wrong sync
                    params[name].add_(torch.randn_like(params[name]) * self.sync_noise)
        return True, "Succeeded to update model weights."

    def perturb(self, scale: float, seed: int) -> None:
        """Every tensor of the weights loaded last plus Gaussian noise of ``scale`` x its own
        std (0: those weights again): a copy of the model that is wrong everywhere, a little."""
        if self.unperturbed is None:
            self.unperturbed = {k: v.clone() for k, v in self.model.params.items()}
        gen = torch.Generator().manual_seed(seed)
        with self.compute, torch.no_grad():
            for name in sorted(self.unperturbed):
                base = self.unperturbed[name]
                std = float(base.std()) if base.numel() > 1 else 0.0
                noise = torch.randn(base.shape, generator=gen) * (scale * std)
                self.model.params[name].copy_(base + noise)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.log_request("/update_weights_from_disk", body)
        bad = missing_fields(body, ("model_path",))
        if bad is not None:
            return bad
        if self.die_on_sync:
            print("AttributeError: 'Parameter' object has no attribute 'weight_loader'",
                  flush=True)
            os._exit(1)
        await asyncio.sleep(self.update_delay)
        folder = Path(body["model_path"])
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            ok, message = False, f"Failed to update weights: no safetensors in {folder}."
        else:
            named = [kv for f in files for kv in load_file(str(f)).items()]
            ok, message = await asyncio.get_running_loop().run_in_executor(
                None, self.load_named, named)
        if ok:
            self.model_path = str(folder)
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
        return web.json_response({"success": ok, "message": message, "num_paused_requests": 0},
                                 status=200 if ok else 400)

    def join_group(self, body: dict) -> tuple[bool, str]:
        from torch.distributed.distributed_c10d import (Backend, PrefixStore,
                                                        _new_process_group_helper, _world,
                                                        rendezvous)
        try:
            # As SGLang's init_custom_process_group: rendezvous, prefix store, helper.
            timeout = timedelta(seconds=120)
            rank = body["rank_offset"]  # + tp_rank, which is 0 here
            store, rank, world = next(rendezvous(
                f"tcp://{body['master_address']}:{body['master_port']}", rank,
                body["world_size"], timeout=timeout))
            store.set_timeout(timeout)
            name = body.get("group_name", "weight_update_group")
            pg, _ = _new_process_group_helper(world, rank, [], Backend(body.get("backend",
                                                                               "nccl")),
                                              PrefixStore(name, store), group_name=name,
                                              timeout=timeout)
            _world.pg_group_ranks[pg] = {i: i for i in range(world)}
            self.groups[name] = pg
            return True, "Succeeded to initialize custom process group."
        except Exception as e:  # noqa: BLE001 - reported to the client, as SGLang does
            return False, f"Failed to initialize custom process group: {e}."

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.log_request("/init_weights_update_group", body)
        bad = missing_fields(body, ("master_address", "master_port", "rank_offset",
                                    "world_size"))
        if bad is not None:
            return bad
        ok, message = await asyncio.get_running_loop().run_in_executor(None, self.join_group,
                                                                       body)
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    def receive(self, body: dict) -> tuple[bool, str]:
        group = self.groups[body.get("group_name", "weight_update_group")]
        named, handles = [], []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(torch.distributed.broadcast(t, src=0, group=group, async_op=True))
            named.append((name, t))
        for h in handles:
            h.wait()
        return self.load_named(named)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.log_request("/update_weights_from_distributed", body)
        bad = missing_fields(body, ("names", "dtypes", "shapes"))
        if bad is not None:
            return bad
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            return web.json_response({"success": False, "message": (
                f"Group {name} not in {list(self.groups)}. Please call "
                "`init_weights_update_group` first.")}, status=400)
        if not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
            return web.json_response({"success": False, "message": "names, dtypes and shapes "
                                      "differ in length"}, status=400)
        ok, message = await asyncio.get_running_loop().run_in_executor(None, self.receive, body)
        if ok and body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
            message += f" Weight version updated to {self.weight_version}."
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body.get("group_name", "weight_update_group") if isinstance(body, dict) else None
        if name in self.groups:
            torch.distributed.destroy_process_group(self.groups.pop(name))
            return web.json_response({"success": True, "message": "Succeeded to destroy custom "
                                      "process group."})
        return web.json_response({"success": False, "message": "The group to be destroyed does "
                                  "not exist."}, status=400)

    # ------------------------------------------------------------------------ LoRA adapters

    def lora_answer(self, ok: bool, error: str = "") -> web.Response:
        """LoadLoRAAdapterReqOutput / UnloadLoRAAdapterReqOutput; 400 when it failed."""
        return web.json_response({"success": ok, "error_message": error,
                                  "loaded_adapters": self.loaded_adapters() if ok else None},
                                 status=200 if ok else 400)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.log_request("/load_lora_adapter", body)
        bad = missing_fields(body, ("lora_name", "lora_path"))
        if bad is not None:
            return bad
        if not self.args.enable_lora:
            return self.lora_answer(False, LORA_DISABLED)
        try:
            adapter = await asyncio.get_running_loop().run_in_executor(
                None, Adapter, body["lora_path"], self.model)
        except (ValueError, OSError) as e:
            return self.lora_answer(False, str(e))
        error = self.admit(body["lora_name"], adapter)
        return self.lora_answer(not error, error)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.log_request("/unload_lora_adapter", body)
        bad = missing_fields(body, ("lora_name",))
        if bad is not None:
            return bad
        name = body["lora_name"]
        if not self.args.enable_lora:
            return self.lora_answer(False, LORA_DISABLED)
        if name not in self.adapters:
            return self.lora_answer(False, f"LoRA with name {name} does not exist. Loaded "
                                           f"LoRAs: {self.adapters.keys()}")
        # Unregistered first (new requests naming it are refused), dropped once unused.
        del self.adapters[name]
        while self.adapter_users.get(name, 0):
            await asyncio.sleep(0.01)
        self.adapter_users.pop(name, None)
        return self.lora_answer(True)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.log_request("/update_weight_version", body)
        bad = missing_fields(body, ("new_version",))
        if bad is not None:
            return bad
        self.weight_version = body["new_version"]
        return web.json_response({"success": True, "message": f"Weight version updated to "
                                  f"{self.weight_version}", "new_version": self.weight_version})

    # ------------------------------------------------------------------------ the rest

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.log_request("/pause_generation", body)
        bad = missing_fields(body, ())
        if bad is not None:
            return bad
        if body.get("mode", "abort") not in PAUSE_MODES:  # SGLang answers validation errors 400
            return web.json_response({"object": "error", "message": "1 validation error: mode: "
                                      f"Input should be {PAUSE_MODES}",
                                      "type": "BadRequestError", "param": None, "code": 400},
                                     status=400)
        self.pause_mode = body.get("mode", "abort")
        self.aborts += self.pause_mode == "abort"
        self.unpaused.clear()
        if self.pause_mode != "abort":
            self.decoding.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.log_request("/continue_generation", body)
        bad = missing_fields(body, ())
        if bad is not None:
            return bad
        self.pause_mode = None
        self.unpaused.set()
        self.decoding.set()
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.log_request("/flush_cache", None)
        # SGLang answers `ret.message or "Flush cache failed.\n"`, and its scheduler gives no
        # message when requests run or wait: the same answer as the race on an idle server
        # right after a request returned (the scheduler still held its batch).
        if self.flush_fails > 0 and not (self.running or self.waiting):
            self.flush_fails -= 1
            return web.Response(text="Flush cache failed.\n", status=400)
        if self.running or self.waiting:
            return web.Response(text="Flush cache failed.\n", status=400)
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation "
                                 "will not be performed.)\n")

    async def health(self, request: web.Request) -> web.Response:
        if self.running:
            await asyncio.sleep(self.args.busy_health_delay_s)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path,
                                  "tokenizer_path": self.args.model_path,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": self.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tp_size": 1, "dp_size": 1,
                                  "weight_version": self.weight_version,
                                  "enable_lora": self.args.enable_lora,
                                  "max_lora_rank": self.lora_rank or None,
                                  "lora_target_modules": self.lora_modules or None,
                                  "max_loras_per_batch": self.args.max_loras_per_batch,
                                  "max_loaded_loras": self.args.max_loaded_loras,
                                  "version": self.version, "internal_states": [{}]})

    async def fake_knob(self, request: web.Request) -> web.Response:
        body = await request.json()
        knob = request.match_info["knob"]
        if knob == "corrupt_syncs":
            self.sync_noise = float(body["noise"])
        elif knob == "die_on_next_sync":
            self.die_on_sync = True
        elif knob == "abort_next":
            self.abort_next = int(body["count"])
        elif knob == "flush_fails":
            self.flush_fails = int(body["count"])
        elif knob == "update_delay":
            self.update_delay = float(body["seconds"])
        elif knob == "perturb":
            scale, seed = float(body["scale"]), int(body.get("seed", 0))
            if body.get("after_requests"):
                self.perturb_later = (int(body["after_requests"]), scale, seed)
            else:
                self.perturb(scale, seed)
        else:
            return web.Response(status=404)
        return web.json_response({"ok": True})

    async def fake_state(self, request: web.Request) -> web.Response:
        return web.json_response({"running": self.running, "waiting": self.waiting,
                                  "decoded": self.decoded})

    @web.middleware
    async def exit_after(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """--exit-after: the answer to the first request to that path is sent, then the process
        ends at once (nothing listens any more, as after SIGKILL)."""
        response = await handler(request)
        if request.path == self.args.exit_after:
            await response.prepare(request)
            await response.write_eof()
            print(f"exiting after answering {request.path} (--exit-after)", flush=True)
            os._exit(1)
        return response

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024**3,
                              middlewares=[self.exit_after] if self.args.exit_after else [])
        app.router.add_route("POST", "/generate", self.generate)
        app.router.add_route("PUT", "/generate", self.generate)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_post("/init_weights_update_group", self.init_weights_update_group)
        app.router.add_post("/update_weights_from_distributed",
                            self.update_weights_from_distributed)
        app.router.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_post("/update_weight_version", self.update_weight_version)
        app.router.add_post("/pause_generation", self.pause_generation)
        app.router.add_post("/continue_generation", self.continue_generation)
        app.router.add_route("GET", "/flush_cache", self.flush_cache)
        app.router.add_route("POST", "/flush_cache", self.flush_cache)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/fake/state", self.fake_state)
        app.router.add_post("/fake/{knob}", self.fake_knob)
        return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--version", default="0.5.23", help="the SGLang release to behave as")
    ap.add_argument("--token-delay-s", type=float, default=0.0)
    ap.add_argument("--busy-health-delay-s", type=float, default=0.0)
    ap.add_argument("--warmup-s", type=float, default=0.0)
    ap.add_argument("--request-log", default=None)
    ap.add_argument("--sync-noise", type=float, default=0.0)
    ap.add_argument("--exit-after", default=None, help="exit once this path was answered")
    ap.add_argument("--enable-lora", action="store_true")
    ap.add_argument("--max-lora-rank", type=int, default=None)
    ap.add_argument("--lora-target-modules", nargs="*", default=None)
    ap.add_argument("--max-loras-per-batch", type=int, default=8)
    ap.add_argument("--max-loaded-loras", type=int, default=None)
    ap.add_argument("--lora-paths", nargs="*", default=[])
    args = ap.parse_args()
    torch.set_num_threads(1)
    server = FakeSGLang(args)
    print(f"fake sglang {args.version} serving {args.model_path} on {args.host}:{args.port}",
          flush=True)
    web.run_app(server.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
