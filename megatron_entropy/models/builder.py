"""Build a Megatron-Core GPTModel (this rank's TP/PP part) from a ``ModelArch``."""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from megatron_entropy.models.arch import ModelArch, UnsupportedModelError
from megatron_entropy.runtime import dtypes

# Deferred imports: Megatron (~4-5 s) loads inside the functions that use it, because the CLI
# checks the model with models/ before any rank starts (cli._check_model, which imports DTYPES
# from here through megatron_checkpoint.py); transformer_engine is optional (GPU only).

# The torch view of the one dtype table.
DTYPES = {name: getattr(torch, d.long_name) for name, d in dtypes.DTYPES.items()}


def transformer_engine_available() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # an empty meta-package or a CUDA mismatch: fall back to the local spec
        return False
    return True


def resolve_transformer_impl(impl: str) -> str:
    if impl == "auto":
        return "transformer_engine" if transformer_engine_available() else "local"
    if impl == "transformer_engine" and not transformer_engine_available():
        raise RuntimeError("model.transformer_impl=transformer_engine needs CUDA and an importable "
                           "transformer_engine (pip install -e .[gpu]); use 'local' or 'auto'")
    return impl


@dataclass(frozen=True)
class MoeOptions:
    """Training choices of a mixture-of-experts model that its HF config does not fix."""

    aux_loss_coeff: Optional[float] = None  # load balancing; None: the HF config's coefficient
    z_loss_coeff: float = 0.0
    routing_replay: bool = False  # build Megatron's RouterReplay into every router


def moe_kwargs(arch: ModelArch, expert: int, moe: MoeOptions) -> dict:
    """TransformerConfig's MoE fields for ``arch`` (none for a dense model)."""
    if not arch.is_moe:
        return {}
    aux = arch.router_aux_loss_coef if moe.aux_loss_coeff is None else moe.aux_loss_coeff
    return dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_topk,
        # Without renormalisation HF takes the top-k of the softmax over all experts (Megatron's
        # pre-softmax); with it, the softmax over the top-k logits is the same numbers.
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_score_function="softmax",
        # HF routes on fp32 probabilities; a bf16 router would pick other experts on near ties.
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_grouped_gemm=False,
        moe_enable_routing_replay=moe.routing_replay,
        expert_model_parallel_size=expert,
    )


def transformer_config(arch: ModelArch, tensor: int = 1, pipeline: int = 1, dtype: str = "fp32",
                       sequence_parallel: bool = False, recompute: bool = False,
                       use_cpu_initialization: Optional[bool] = None, expert: int = 1,
                       moe: MoeOptions = MoeOptions(), context: int = 1):
    from megatron.core.transformer import TransformerConfig

    arch.check_parallel(tensor, pipeline, expert)
    if arch.is_moe and tensor > 1 and not sequence_parallel:
        # Megatron-Core refuses MoE with TP and without sequence parallelism, which in turn
        # needs Transformer Engine (GPU).
        raise UnsupportedModelError(
            f"parallel.tensor={tensor} with a mixture-of-experts model needs "
            "parallel.sequence_parallel=true (GPU with Transformer Engine); on the CPU use "
            "parallel.tensor=1 and parallel.expert for the experts")
    on_gpu = torch.cuda.is_available()
    params_dtype = DTYPES[dtype]
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.init_std,
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        context_parallel_size=context,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        # Same full weights on every layout (TP=2 equals TP=1) and no CUDA needed to build.
        use_cpu_initialization=(not on_gpu) if use_cpu_initialization is None
        else use_cpu_initialization,
        # RL batches have a different length every micro-batch.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        # Fused kernels (apex/TE/jit) only where they exist.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        batch_p2p_sync=on_gpu,
        **moe_kwargs(arch, expert, moe),
    )
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    return TransformerConfig(**kwargs)


def layer_spec(arch: ModelArch, impl: Literal["local", "transformer_engine"]):
    from megatron.core.models.gpt import gpt_layer_specs

    if impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=arch.num_experts or None, qk_layernorm=arch.qk_layernorm)
    from megatron_entropy.models.attention import SdpaDotProductAttention

    # Local spec: SequentialMLP experts (one Megatron MLP per local expert, no grouped GEMM);
    # the core attention through torch's fused SDPA (models/attention.py).
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=arch.num_experts or None,
                                                    qk_layernorm=arch.qk_layernorm,
                                                    normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention
    return spec


def build_gpt_model(arch: ModelArch, tensor: int = 1, pipeline: int = 1, dtype: str = "fp32",
                    transformer_impl: str = "auto", seq_length: int = 4096,
                    sequence_parallel: bool = False, recompute: bool = False,
                    use_cpu_initialization: Optional[bool] = None, expert: int = 1,
                    moe: MoeOptions = MoeOptions()):
    """This rank's part of the model, for the parallel state already initialised.

    The output layer returns vocab-parallel logits [S, B, V/tp] (``parallel_output=True``); the
    vocab is padded to ``arch.padded_vocab_size`` and the padded columns must be masked by the
    caller (the ops take the real vocab size).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    impl = resolve_transformer_impl(transformer_impl)
    # The context-parallel size is the parallel state's: the model splits sequences as its
    # groups do.
    config = transformer_config(arch, tensor, pipeline, dtype, sequence_parallel, recompute,
                                use_cpu_initialization, expert, moe,
                                context=parallel_state.get_context_parallel_world_size())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
        spec = layer_spec(arch, impl)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=max(seq_length, 16),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
    )
    # The local spec's torch RMSNorm ignores params_dtype: its weights would stay fp32 in a bf16
    # model, and Megatron's mixed-precision optimizer mis-pairs such mixed dtypes in its
    # checkpoints (Megatron-LM casts the whole model in Float16Module; buffers stay as they are).
    for param in model.parameters():
        if param.dtype != config.params_dtype:
            param.data = param.data.to(config.params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
