"""``megatron-entropy plan``: the job layout and a per-GPU memory estimate, before the job queues.

For a config and a node count it splits the nodes as the slurm/ scripts will (rollout servers on
the first ``cluster.server_nodes`` nodes, the trainer on the rest), derives TP x PP x DP, and
estimates the memory of the fullest trainer GPU and of a server GPU. A layout that cannot run
(too few nodes, a TP/PP that does not divide the model or the GPUs, memory over the GPU's) is
refused with the reason and exit code 1.

The estimate follows what the trainer builds (models/builder.py, trainer/model_setup.py):
- weights in ``model.dtype``; Megatron DDP's fp32 grad buffer; fp32 main weights (bf16/fp16
  runs) and Adam's two fp32 moments, on every DP rank with the plain optimizer, 1/DP of them per
  rank with the distributed optimizer (``trainer.distributed_optimizer``);
- activations of one micro-batch of ``trainer.micro_batch_tokens`` tokens (at least one full
  sequence), 1/CP of them per context-parallel rank: every layer input when
  ``model.recompute_activations`` (full recompute) plus one layer's full set, or every layer's full
  set without recompute; the first pipeline stage holds ``pipeline`` micro-batches in flight (1F1B);
  with CP each layer also keeps the keys and values of the whole micro-batch that its attention
  gathered (the all-gather's output, for the backward);
- the LM head: one chunk of logits in ``model.dtype`` plus the fp32 scratch its rows are worked
  through in (fused log-prob), or the micro-batch's logits (chunked);
- in-process rollout: a full model copy in ``rollout.dtype`` and its KV cache on each DP leader;
- a server GPU: weights / server_gpus, the rest of 90% of the GPU is KV cache (vLLM/SGLang default);
- LoRA (``model.lora``): the base weights frozen in ``model.dtype``; the grad buffer, main
  weights and Adam moments of the adapters only (column-parallel layers keep A whole and split
  B over TP, row-parallel ones split A and keep B whole); no reference copy (the reference is
  the policy with its adapters off);
- mixture of experts: each GPU holds its EP rank's experts (num_experts / EP, TP-split) and the
  router; the distributed optimizer shards the experts' state over DP / EP; the weights, grads
  and optimizer state are printed with their dense and expert parts; a token's activations count
  its k experts; the all-to-all volume is a note (``all_to_all_bytes``).
Activation sizes count the tensors autograd keeps (bf16), not the allocator's peaks, so a trainer
GPU counts as full at 90% of its memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_entropy.config import Config, ConfigError, load_config
from megatron_entropy.models.arch import ModelArch, UnsupportedModelError, arch_from_hf_config, \
    load_arch
from megatron_entropy.models.lora_settings import LoraSettings
from megatron_entropy.ops.logprob_entropy import GPU_SUB_BLOCKS
from megatron_entropy.runtime import ParallelLayoutError
from megatron_entropy.runtime.dtypes import DTYPES
from megatron_entropy.launch.slurm import JobLayout, NotEnoughNodesError, job_layout

GiB = 1024**3
SERVER_MEMORY_FRACTION = 0.9  # vLLM's gpu_memory_utilization / SGLang's mem_fraction_static
SERVER_WORKSPACE = 2 * GiB  # CUDA graphs, sampler and activation workspace of a server
RUNTIME_OVERHEAD = 2 * GiB  # CUDA context, NCCL buffers
TRAINER_MEMORY_LIMIT = 0.9  # refuse above this share of the GPU: the estimate is not exact
# Trainer GPUs per rollout-server GPU above which a layout waits on its rollouts: generating
# long reasoning responses takes most of an RL step even on as many GPUs as the update (the
# recipes split their nodes 1:1), so a few times fewer server GPUs leave the trainer idle.
ROLLOUT_BOUND_RATIO = 4

# What the two Qwen3-MoE models' config.json files share.
_QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, num_key_value_heads=4,
                  head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                  max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, router_aux_loss_coef=0.001)

# The public config.json numbers of the paper's models and of Qwen3's MoE models, for planning
# before the weights are downloaded (model.hf_path's folder name selects one when it has no
# config.json yet).
KNOWN_MODELS = {
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, max_position_embeddings=131072, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2.5-32b": dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=5120,
                        intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=1e6,
                        rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_hidden_layers=94,
                            num_attention_heads=64),
}


def resolve_arch(cfg: Config, model_config: Optional[str] = None) -> tuple[ModelArch, str]:
    """The model's architecture and where it came from (a config.json or the built-in table)."""
    if model_config:
        path = Path(model_config)
        return (load_arch(path) if path.is_dir() else _arch_from_file(path)), str(path)
    hf = Path(cfg.model.hf_path) if cfg.model.hf_path else None
    if hf and (hf / "config.json").is_file():
        return load_arch(hf), str(hf / "config.json")
    name = hf.name.lower().removesuffix("-instruct") if hf else ""
    if name in KNOWN_MODELS:
        return (arch_from_hf_config(KNOWN_MODELS[name], where=f"built-in {hf.name}"),
                f"built-in {name} (no config.json in {str(hf)!r} yet)")
    raise ConfigError(f"model.hf_path={cfg.model.hf_path!r} has no config.json; pass "
                      "--model-config PATH (a config.json) or use a known model name "
                      f"({', '.join(KNOWN_MODELS)})")


def _arch_from_file(path: Path) -> ModelArch:
    if not path.is_file():
        raise ConfigError(f"--model-config {str(path)!r} does not exist")
    return arch_from_hf_config(json.loads(path.read_text()), where=str(path))


# ------------------------------------------------------------------------------------ counting


def expert_params(a: ModelArch) -> int:
    """One routed expert's SwiGLU (0 for a dense model)."""
    return 3 * a.hidden_size * a.moe_ffn_hidden_size if a.is_moe else 0


def layer_params(a: ModelArch) -> int:
    q, kv = a.num_attention_heads * a.head_dim, a.num_query_groups * a.head_dim
    attn = a.hidden_size * (q + 2 * kv) + q * a.hidden_size + ((q + 2 * kv) if a.qkv_bias else 0)
    mlp = (a.num_experts * (expert_params(a) + a.hidden_size) if a.is_moe  # experts + router
           else 3 * a.hidden_size * a.ffn_hidden_size)
    norms = 2 * a.hidden_size + (2 * a.head_dim if a.qk_layernorm else 0)
    return attn + mlp + norms


def active_params(a: ModelArch) -> int:
    """Parameters one token uses (a mixture of experts runs top-k of its experts)."""
    idle = (a.num_experts - a.moe_topk) * expert_params(a) if a.is_moe else 0
    return total_params(a) - a.num_layers * idle


def total_params(a: ModelArch) -> int:
    """Parameters of the HF model (real vocabulary)."""
    emb = a.vocab_size * a.hidden_size
    return a.num_layers * layer_params(a) + emb * (1 if a.tie_word_embeddings else 2) \
        + a.hidden_size


def stage_expert_params(a: ModelArch, tensor: int, pipeline: int, expert: int = 1) -> int:
    """Routed-expert parameters on one GPU of a stage: its EP rank's experts, TP-split."""
    return a.num_layers // pipeline * a.num_experts // expert * expert_params(a) // tensor


def stage_params(a: ModelArch, tensor: int, pipeline: int, expert: int = 1) -> int:
    """Parameters on one GPU of the fullest pipeline stage (padded vocab). TP splits every weight
    but the norms (and an MoE router); EP splits the experts; the first stage holds the
    embedding, the last the final norm and the output layer (with tied embeddings and PP > 1, a
    copy of the embedding)."""
    q, kv = a.num_attention_heads * a.head_dim, a.num_query_groups * a.head_dim
    mlp = 0 if a.is_moe else 3 * a.hidden_size * a.ffn_hidden_size
    split = (a.hidden_size * (q + 2 * kv) + q * a.hidden_size + mlp
             + ((q + 2 * kv) if a.qkv_bias else 0))
    norms = 2 * a.hidden_size + (2 * a.head_dim if a.qk_layernorm else 0)
    router = a.num_experts * a.hidden_size
    layers = a.num_layers // pipeline * (split // tensor + norms + router) \
        + stage_expert_params(a, tensor, pipeline, expert)
    emb = a.padded_vocab_size * a.hidden_size // tensor
    if pipeline == 1:
        return layers + emb + a.hidden_size + (0 if a.tie_word_embeddings else emb)
    return layers + a.hidden_size + emb  # the last stage; the first has the same minus a norm


def stage_adapter_params(a: ModelArch, lora: LoraSettings, tensor: int, pipeline: int,
                         expert: int = 1) -> tuple[int, int]:
    """LoRA adapters on one GPU of a stage: (dense, experts'), sharded as models/lora.py does:
    a column-parallel layer's A whole and its B split over TP, a row-parallel one's A split
    and its B whole; each local expert its own adapters."""
    r, h = lora.rank, a.hidden_size
    q, kv = a.num_attention_heads * a.head_dim, a.num_query_groups * a.head_dim
    ffn = a.moe_ffn_hidden_size if a.is_moe else a.ffn_hidden_size
    size = {"linear_qkv": r * h + r * (q + 2 * kv) // tensor,  # column: A [r, in], B [out/tp, r]
            "linear_proj": r * q // tensor + r * h,  # row: A [r, in/tp], B [out, r]
            "linear_fc1": r * h + r * 2 * ffn // tensor, "linear_fc2": r * ffn // tensor + r * h}
    layers = a.num_layers // pipeline
    attn = sum(size[t] for t in lora.targets if t in ("linear_qkv", "linear_proj"))
    mlp = sum(size[t] for t in lora.targets if t in ("linear_fc1", "linear_fc2"))
    if a.is_moe:
        return layers * attn, layers * a.num_experts // expert * mlp
    return layers * (attn + mlp), 0


def kv_bytes_per_token(a: ModelArch, dtype_bytes: int, tensor: int = 1) -> float:
    """K and V of one token over all layers on one GPU of a TP group (KV heads split by TP)."""
    heads = max(a.num_query_groups / tensor, 1)
    return 2 * a.num_layers * heads * a.head_dim * dtype_bytes


def layer_activation_elems(a: ModelArch, tensor: int, sequence_parallel: bool) -> float:
    """Elements autograd keeps per token for one layer (flash attention: no S x S scores)."""
    q, kv = a.num_attention_heads * a.head_dim, a.num_query_groups * a.head_dim
    replicated = 4 * a.hidden_size  # two norm inputs, the two normed inputs to QKV and FC1
    split = (q + 2 * kv) + q + 3 * a.ffn_hidden_size  # QKV out, attention out, FC1 out, SwiGLU out
    if a.is_moe:
        # Router logits and probs, each token's k dispatched copies (the experts' inputs) and
        # their FC1 and SwiGLU outputs.
        replicated += 2 * a.num_experts + a.moe_topk * a.hidden_size
        split = (q + 2 * kv) + q + a.moe_topk * 3 * a.moe_ffn_hidden_size
    return replicated / (tensor if sequence_parallel else 1) + split / tensor


def all_to_all_bytes(a: ModelArch, tokens: float, expert: int, passes: int,
                     dtype_bytes: int = 2) -> float:
    """Bytes one GPU sends through the MoE token dispatcher for ``tokens`` tokens of its own
    stage: per MoE layer and pass (a forward or a backward) each token's k copies go out and
    come back (dispatch and combine), all but the 1/EP that stay on the GPU."""
    if not a.is_moe or expert == 1:
        return 0.0
    per_token = 2 * a.moe_topk * a.hidden_size * dtype_bytes * (expert - 1) / expert
    return tokens * per_token * passes


# ------------------------------------------------------------------------------------ the plan


@dataclass
class Plan:
    arch: ModelArch
    arch_source: str
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    layout: Optional[JobLayout]
    tensor: int
    pipeline: int
    data_parallel: int = 0
    expert: int = 1
    context: int = 1
    trainer: list[tuple[str, float]] = field(default_factory=list)  # (item, bytes) worst GPU
    # A mixture of experts: item -> its (dense part, bytes), (experts' part, bytes).
    trainer_parts: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    server: list[tuple[str, float]] = field(default_factory=list)  # (item, bytes) one server GPU
    server_kv_tokens: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # fits, but wastes GPUs
    # Rollout-bound: the imbalance, and the plan of the node split that balances it (if one
    # fits), for the verdict.
    rollout_bound: str = ""
    balanced: Optional["Plan"] = None

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def trainer_bytes(self) -> float:
        return sum(b for _, b in self.trainer)


def make_plan(cfg: Config, arch: ModelArch, nodes: int, arch_source: str = "",
              rebalance: bool = True) -> Plan:
    """Layout and memory estimate for ``cfg`` on ``nodes`` nodes of ``cfg.cluster``'s shape;
    ``rebalance``: a rollout-bound plan also plans the node split that balances it."""
    c, p, r, t = cfg.cluster, cfg.parallel, cfg.rollout, cfg.trainer
    plan = Plan(arch=arch, arch_source=arch_source, nodes=nodes, gpus_per_node=c.gpus_per_node,
                gpu_memory_gb=c.gpu_memory_gb, layout=None, tensor=p.tensor, pipeline=p.pipeline,
                expert=p.expert, context=p.context)
    try:
        arch.check_parallel(p.tensor, p.pipeline, p.expert)
        plan.layout = job_layout(cfg, [f"node{i}" for i in range(nodes)])
    except (UnsupportedModelError, ParallelLayoutError, NotEnoughNodesError, ConfigError) as e:
        plan.problems.append(str(e))
        return plan
    lay = plan.layout
    if lay.shared:
        plan.problems.append(
            "cluster.server_nodes=0 puts the rollout servers on the first trainer node, beside "
            "the trainer's GPUs: that is for CPU tests; give the servers nodes of their own")
    plan.data_parallel = lay.trainer_tasks // (p.tensor * p.pipeline * p.context)
    if plan.data_parallel % p.expert:
        plan.problems.append(f"parallel.expert={p.expert} does not divide the data-parallel size "
                             f"{plan.data_parallel}")
        return plan
    seq = r.max_prompt_tokens + r.max_new_tokens
    if t.micro_batch_tokens < seq:
        plan.problems.append(f"trainer.micro_batch_tokens={t.micro_batch_tokens} cannot hold one "
                             f"full sequence of {seq} tokens")
    _plan_trainer_state(plan, cfg)
    _plan_trainer_work(plan, cfg, seq)
    if lay.num_servers and not lay.shared:  # rollout servers on their own nodes
        _plan_servers(plan, cfg, seq)
    if plan.rollout_bound and rebalance:  # the recipes' 1:1 split, where it fits
        even = make_plan(dataclasses.replace(cfg, cluster=dataclasses.replace(
            c, server_nodes=nodes // 2)), arch, nodes, arch_source, rebalance=False)
        plan.balanced = even if even.fits and not even.rollout_bound else None
    mini = t.mini_batches_per_step
    batch_seqs = cfg.data.prompts_per_step * r.n_samples
    if batch_seqs % (plan.data_parallel * mini):
        plan.notes.append(f"{batch_seqs} sequences per step do not split evenly over DP="
                          f"{plan.data_parallel} x {mini} mini-batches")
    return plan


def _plan_trainer_state(plan: Plan, cfg: Config) -> None:
    """The trainer's fullest GPU (the first pipeline stage): weights, grads, optimizer state
    and the reference model, dense and expert parts apart for MoE."""
    arch, p, t = plan.arch, cfg.parallel, cfg.trainer
    n = stage_params(arch, p.tensor, p.pipeline, p.expert)
    experts = stage_expert_params(arch, p.tensor, p.pipeline, p.expert)
    w = DTYPES[cfg.model.dtype].bytes

    def add(item: str, dense: float, expert: float) -> None:
        """An item of the dense parameters (router included) and the experts, apart for MoE."""
        plan.trainer.append((item, dense + expert))
        if experts:
            plan.trainer_parts[item] = [
                ("dense (attention, norms, router, embeddings)", dense),
                (f"experts ({arch.num_experts // p.expert} of {arch.num_experts} a layer)",
                 expert)]

    # What is trained: every weight, or (model.lora) the adapters over a frozen base.
    lora = cfg.model.lora
    dense_trained, expert_trained = (
        stage_adapter_params(arch, lora, p.tensor, p.pipeline, p.expert) if lora.enabled
        else (n - experts, experts))
    add(f"weights ({cfg.model.dtype}{', frozen' if lora.enabled else ''})", (n - experts) * w,
        experts * w)
    if lora.enabled:
        add(f"LoRA adapters (rank {lora.rank}, {cfg.model.dtype})", dense_trained * w,
            expert_trained * w)
        plan.problems += lora_problems(cfg, arch)
    add("grad buffer (fp32)", dense_trained * 4, expert_trained * 4)
    # The distributed optimizer keeps each DP (x CP) rank's 1/(DP x CP) of the main weights and
    # moments; an expert's over the DP ranks that hold the same experts (DP / EP).
    shards = plan.data_parallel * p.context
    sharded = t.uses_distributed_optimizer(shards)
    expert_dp = plan.data_parallel // p.expert
    dp_shard = f", 1/{shards} by the distributed optimizer" if sharded else ""
    if sharded and experts:
        dp_shard += f" (experts 1/{expert_dp})"
    dense_opt, expert_opt = ((-(-dense_trained // shards), -(-expert_trained // expert_dp))
                             if sharded else (dense_trained, expert_trained))
    if w < 4:
        add(f"fp32 main weights{dp_shard}", dense_opt * 4, expert_opt * 4)
    add(f"Adam moments (fp32{dp_shard})", dense_opt * 8, expert_opt * 8)
    if cfg.algorithm.kl_coef > 0 and not lora.enabled:
        plan.trainer.append((f"reference model ({cfg.model.dtype})", n * w))


def _plan_trainer_work(plan: Plan, cfg: Config, seq: int) -> None:
    """The trainer's fullest GPU, what a step adds: activations, the LM head's work, the
    in-process engine, the runtime's share; the MoE all-to-all volume; whether it fits."""
    arch, c, p, r, t = plan.arch, cfg.cluster, cfg.parallel, cfg.rollout, cfg.trainer
    w = DTYPES[cfg.model.dtype].bytes
    micro_batch = max(t.micro_batch_tokens, seq)  # a longer sequence is a micro-batch alone
    tokens = micro_batch / p.context  # this CP rank's part
    full_layer = layer_activation_elems(arch, p.tensor, p.sequence_parallel) * 2 * tokens
    layers = arch.num_layers // p.pipeline
    in_flight = p.pipeline  # 1F1B: the first stage keeps `pipeline` micro-batches alive
    what = f"{micro_batch} tokens" + (f", 1/{p.context} per CP rank" if p.context > 1 else "")
    if cfg.model.recompute_activations:
        inputs = layers * arch.hidden_size * 2 * tokens / (p.tensor if p.sequence_parallel else 1)
        plan.trainer.append((f"activations (recompute, {in_flight} micro-batch(es) of {what})",
                             in_flight * inputs + full_layer))
    else:
        plan.trainer.append((f"activations ({in_flight} micro-batch(es) of {what})",
                             in_flight * layers * full_layer))
    if p.context > 1:
        kept = layers if not cfg.model.recompute_activations else 1
        plan.trainer.append((f"CP: the gathered keys and values ({kept} layer(s))",
                             in_flight * kept * micro_batch
                             * kv_bytes_per_token(arch, w, p.tensor) / arch.num_layers))
    vocab_shard = arch.padded_vocab_size / p.tensor
    if cfg.algorithm.logprob_impl == "fused":
        # At most two fp32 scratch blocks of 1/GPU_SUB_BLOCKS of the chunk beside it.
        logits = min(cfg.algorithm.logprob_chunk_tokens, tokens) * vocab_shard * (
            w + 2 * 4 / GPU_SUB_BLOCKS)
        plan.trainer.append(("LM head (one fused chunk of logits)", logits))
    else:
        logits = tokens * vocab_shard * (w + 4 * 2)
        plan.trainer.append(("LM head (micro-batch logits + fp32 chunk work)", logits))
    if r.engine == "inprocess":
        rw = DTYPES[r.dtype].bytes
        plan.trainer.append((f"in-process engine weights ({r.dtype})", total_params(arch) * rw))
        kv = r.batch_size * seq * kv_bytes_per_token(arch, rw)
        if r.kv_cache_gb > 0:  # the engine decodes fewer sequences at once beyond it
            kv = min(kv, r.kv_cache_gb * GiB)
        plan.trainer.append((f"in-process KV cache ({r.batch_size} x {seq} tokens"
                             + (f", at most {r.kv_cache_gb:g} GiB" if r.kv_cache_gb > 0 else "")
                             + ")", kv))
    if arch.is_moe and p.expert > 1:
        # Recompute (forward), then each epoch's forward and backward over the step's tokens.
        tokens_per_gpu = cfg.data.prompts_per_step * r.n_samples * seq / plan.data_parallel
        passes = arch.num_layers // p.pipeline * (1 + 2 * t.ppo_epochs)
        volume = all_to_all_bytes(arch, tokens_per_gpu, p.expert, passes, w)
        plan.notes.append(f"MoE all-to-all: up to {volume / GiB:.1f} GiB sent per GPU per step "
                          f"(full-length sequences; EP {p.expert}, top-{arch.moe_topk})")
    slack = 0.1 * sum(b for name, b in plan.trainer if name.startswith(("activ", "LM", "in-p")))
    plan.trainer.append(("CUDA context, NCCL, allocator slack", RUNTIME_OVERHEAD + slack))
    if plan.trainer_bytes > TRAINER_MEMORY_LIMIT * c.gpu_memory_gb * GiB:
        plan.problems.append(
            f"the trainer needs ~{plan.trainer_bytes / GiB:.1f} GiB on its fullest GPU, over "
            f"{100 * TRAINER_MEMORY_LIMIT:.0f}% of the {c.gpu_memory_gb:g} GiB of "
            "cluster.gpu_memory_gb: raise parallel.tensor / parallel.pipeline / "
            "parallel.context, set model.recompute_activations, lower "
            "trainer.micro_batch_tokens"
            + (", lower rollout.batch_size or use a server engine" if r.engine == "inprocess"
               else ""))


def _plan_servers(plan: Plan, cfg: Config, seq: int) -> None:
    """A rollout server on nodes of its own: weights, workspace, the KV cache of the rest; how
    many sequences the servers hold at once; whether the trainer waits on them."""
    arch, c, lay = plan.arch, cfg.cluster, plan.layout
    sw = total_params(arch) * 2 / c.server_gpus
    budget = SERVER_MEMORY_FRACTION * c.gpu_memory_gb * GiB
    plan.server = [("weights (bf16)", sw), ("workspace", SERVER_WORKSPACE)]
    kv = budget - sw - SERVER_WORKSPACE
    per_token = kv_bytes_per_token(arch, 2, c.server_gpus)
    plan.server_kv_tokens = max(int(kv // per_token), 0)
    plan.server.append(("KV cache (the rest)", max(kv, 0)))
    if plan.server_kv_tokens < seq:
        plan.problems.append(
            f"a server of {c.server_gpus} GPU(s) has room for {plan.server_kv_tokens} KV "
            f"tokens, less than one {seq}-token sequence: raise cluster.server_gpus")
    else:
        in_flight_seqs = lay.num_servers * (plan.server_kv_tokens // seq)
        batch = cfg.data.prompts_per_step * cfg.rollout.n_samples
        plan.notes.append(
            f"{lay.num_servers} servers hold {in_flight_seqs} full-length sequences at once "
            f"for a rollout batch of {batch}"
            + ("" if in_flight_seqs >= batch else " (generated in waves)"))
    server_gpus = lay.num_servers * c.server_gpus
    if lay.trainer_tasks > ROLLOUT_BOUND_RATIO * server_gpus:
        plan.rollout_bound = (f"{lay.trainer_tasks} trainer GPUs wait on {server_gpus} rollout "
                              f"server GPUs ({lay.trainer_tasks / server_gpus:.0f} to 1)")
        plan.warnings.append(
            f"rollout-bound: {plan.rollout_bound[:-1]}; above {ROLLOUT_BOUND_RATIO} to 1 "
            "generation leaves the trainer idle most of each step): raise "
            f"cluster.server_nodes (e.g. {plan.nodes // 2}, the recipes' 1:1 split) or run on "
            "fewer nodes")


def lora_problems(cfg: Config, arch: ModelArch) -> list[str]:
    """What the adapters cannot sit on (models/lora.py refuses it when the model is built)."""
    p, out = cfg.parallel, []
    if cfg.model.transformer_impl == "transformer_engine" or p.sequence_parallel:
        out.append("model.lora: adapters sit on the local layer spec's linear layers, without "
                   "sequence parallelism: set model.transformer_impl=local (or auto) and "
                   "parallel.sequence_parallel=false")
    if arch.is_moe and p.tensor > 1 and {"linear_fc1", "linear_fc2"} & set(cfg.model.lora.targets):
        out.append("model.lora: expert adapters with parallel.tensor > 1 are not supported: "
                   "split the experts with parallel.expert")
    return out


def format_plan(plan: Plan) -> str:
    a, lay = plan.arch, plan.layout
    moe = (f" ({active_params(a) / 1e9:.2f}B active: {a.num_experts} experts, top-"
           f"{a.moe_topk})" if a.is_moe else "")
    lines = [f"model: {a.architecture} {total_params(a) / 1e9:.2f}B params{moe}, {a.num_layers} "
             f"layers, hidden {a.hidden_size}, vocab {a.vocab_size} (padded "
             f"{a.padded_vocab_size})" + (f" [{plan.arch_source}]" if plan.arch_source else ""),
             f"nodes: {plan.nodes} x {plan.gpus_per_node} GPUs of {plan.gpu_memory_gb:g} GiB"]
    if lay is not None:
        if lay.num_servers:
            where = ("the first trainer node (shared)" if lay.shared
                     else f"{len(lay.server_nodes)} node(s)")
            lines.append(f"rollout servers: {lay.num_servers} x {lay.server_gpus} GPU(s) on "
                         f"{where}, {lay.servers_per_node} per node")
        lines.append(f"trainer: {len(lay.trainer_nodes)} node(s), {lay.trainer_tasks} GPUs = "
                     f"TP {plan.tensor} x PP {plan.pipeline}"
                     + (f" x CP {plan.context}" if plan.context > 1 else "")
                     + f" x DP {plan.data_parallel}"
                     + (f" (EP {plan.expert}: the experts split over {plan.expert} DP ranks)"
                        if plan.expert > 1 else ""))
    if plan.trainer:
        lines.append("trainer memory per GPU (fullest pipeline stage):")
        for name, b in plan.trainer:
            lines.append(f"  {name:<58} {b / GiB:8.2f} GiB")
            lines += [f"    {part:<56} {pb / GiB:8.2f} GiB"
                      for part, pb in plan.trainer_parts.get(name, [])]
        lines.append(f"  {'total':<58} {plan.trainer_bytes / GiB:8.2f} GiB "
                     f"({100 * plan.trainer_bytes / (plan.gpu_memory_gb * GiB):.0f}% of "
                     f"{plan.gpu_memory_gb:g} GiB)")
    if plan.server:
        lines.append(f"server memory per GPU ({100 * SERVER_MEMORY_FRACTION:.0f}% of the GPU):")
        lines += [f"  {name:<58} {b / GiB:8.2f} GiB" for name, b in plan.server]
        lines.append(f"  KV capacity per server: {plan.server_kv_tokens:,} tokens")
    lines += [f"note: {n}" for n in plan.notes]
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.fits:
        lines.append("verdict: fits" + _imbalance(plan))
    else:
        lines += [f"refused: {msg}" for msg in plan.problems]
    return "\n".join(lines)


def _imbalance(plan: Plan) -> str:
    """What the verdict adds for a rollout-bound plan: the imbalance, and the node split that
    balances it."""
    if not plan.rollout_bound:
        return ""
    even = plan.balanced
    if even is None:
        return f", but rollout-bound: {plan.rollout_bound}; run on fewer nodes"
    lay = even.layout
    return (f", but rollout-bound: {plan.rollout_bound}; cluster.server_nodes="
            f"{len(lay.server_nodes)} balances them ({len(lay.server_nodes)} server + "
            f"{len(lay.trainer_nodes)} trainer nodes: {lay.num_servers * lay.server_gpus} server "
            f"and {lay.trainer_tasks} trainer GPUs, TP {even.tensor} x PP {even.pipeline} x DP "
            f"{even.data_parallel})")


# ------------------------------------------------------------------------------------ CLI


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, help="nodes of the Slurm job (required)")
    parser.add_argument("--gpus-per-node", type=int, help="default: cluster.gpus_per_node")
    parser.add_argument("--gpu-memory-gb", type=float, help="default: cluster.gpu_memory_gb")
    parser.add_argument("--model-config", help="a model's config.json when model.hf_path has none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER,
                        help="dotted overrides, e.g. parallel.tensor=8 (options may follow)")
    _options(parser)


def run(args: argparse.Namespace) -> int:
    # argparse stops at the first override; options after it are parsed here, in any order.
    rest = argparse.ArgumentParser(prog="megatron-entropy plan")
    _options(rest)
    rest.add_argument("overrides", nargs="*")
    late = rest.parse_intermixed_args(args.overrides)
    for key in ("nodes", "gpus_per_node", "gpu_memory_gb", "model_config"):
        if getattr(late, key) is not None:
            setattr(args, key, getattr(late, key))
    overrides = list(late.overrides)
    if args.gpus_per_node is not None:
        overrides.append(f"cluster.gpus_per_node={args.gpus_per_node}")
    if args.gpu_memory_gb is not None:
        overrides.append(f"cluster.gpu_memory_gb={args.gpu_memory_gb}")
    # Bad input is raised: one line and exit 2, as every command reports it (cli.py); a
    # layout that does not fit is printed with the plan and exits 1.
    if args.nodes is None or args.nodes < 1:
        raise ConfigError(f"--nodes must be given and >= 1 (got {args.nodes})")
    cfg = load_config(args.config, overrides)
    arch, source = resolve_arch(cfg, args.model_config)
    plan = make_plan(cfg, arch, args.nodes, source)
    print(format_plan(plan))
    return 0 if plan.fits else 1


PLAN = ("job layout and per-GPU memory estimate of a config on N nodes; refuses a layout that "
        "does not fit", add_arguments, run)
