"""Checks across the config's sections (each section checks its own fields when it is built)."""

from __future__ import annotations

from megatron_entropy.config.schema import Config
from megatron_entropy.settings import ConfigError


def validate(cfg: Config) -> None:
    """Checks across sections (each section checks its own fields when it is built)."""
    r = cfg.rollout
    if cfg.model.seq_length < r.max_prompt_tokens + r.max_new_tokens:
        raise ConfigError(f"model.seq_length ({cfg.model.seq_length}) is shorter than a full "
                          f"sequence: rollout.max_prompt_tokens + rollout.max_new_tokens = "
                          f"{r.max_prompt_tokens} + {r.max_new_tokens} = "
                          f"{r.max_prompt_tokens + r.max_new_tokens}; raise model.seq_length or "
                          "lower those")
    if cfg.algorithm.advantage == "grpo_passk" and r.n_samples < 2:
        raise ConfigError(f"algorithm.advantage=grpo_passk needs rollout.n_samples >= 2 (the "
                          f"gap between a prompt's best and second-best reward); got "
                          f"{r.n_samples}")
    if r.max_staleness > 0 and r.engine == "inprocess":
        raise ConfigError(f"rollout.max_staleness={r.max_staleness} needs a server engine "
                          "(rollout.engine=vllm or sglang); rollout.engine=inprocess shares "
                          "the trainer's processes, so its rollouts stay synchronous: set "
                          "rollout.max_staleness=0")
    if r.max_staleness > 0 and r.inflight_at_sync == "abort" and r.server.router_url:
        raise ConfigError("rollout.inflight_at_sync=abort aborts each request on the server "
                          "that runs it, which rollout.server.router_url hides (the router "
                          "picks it): use rollout.inflight_at_sync=finish or address the "
                          "servers directly (rollout.server.urls)")
    if r.routing_replay == "rollout" and r.engine != "inprocess":
        raise ConfigError(f"rollout.routing_replay=rollout needs each token's routed experts "
                          f"from the engine, which only rollout.engine=inprocess returns "
                          f"(rollout.engine={r.engine}: the server clients do not ask for them; "
                          "vLLM 0.32's CPU build cannot return them: enable_return_routed_experts "
                          "needs its Model Runner V2, which needs Triton): use "
                          "rollout.routing_replay=recompute (R2) or rollout.engine=inprocess")
    _check_weight_sync(cfg)
    if cfg.model.lora.enabled:
        _check_lora(cfg)
    if r.tools.enabled:
        _check_tools(cfg)
    if cfg.algorithm.old_logprobs == "engine":
        _check_engine_old_logprobs(cfg)
    if cfg.reward.overlong_buffer > r.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer={cfg.reward.overlong_buffer} is longer than "
                          f"rollout.max_new_tokens={r.max_new_tokens}: the buffer is the last "
                          "part of the length limit")
    if cfg.parallel.context > 1 and cfg.trainer.micro_batch_layout == "shared_prompt":
        raise ConfigError(f"trainer.micro_batch_layout=shared_prompt: parallel.context="
                          f"{cfg.parallel.context} splits each sequence over its ranks, not "
                          "shared-prompt rows; use trainer.micro_batch_layout=packed, padded "
                          "or auto")
    if cfg.rollout.engine != "inprocess":
        s = cfg.rollout.server
        if not (s.urls or s.urls_file or s.launch):
            raise ConfigError(f"rollout.engine={cfg.rollout.engine} needs servers: set "
                              "rollout.server.urls, rollout.server.urls_file or "
                              "rollout.server.launch")


# The adapter ranks vLLM's LoRA serving is built for (its --max-lora-rank takes one of these).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The weight-sync strategies each engine has the endpoints for (rollout/base.py).
SYNCED_BY = {"inprocess": ("in_place",), "vllm": ("disk", "adapters"),
             "sglang": ("disk", "broadcast", "adapters")}


def _check_weight_sync(cfg: Config) -> None:
    """The strategy of ``rollout.weight_sync`` against ``rollout.engine``, before anything
    loads."""
    r = cfg.rollout
    strategy = r.weight_sync.strategy_for(r.engine)
    allowed = SYNCED_BY[r.engine]
    if strategy not in allowed:
        what = {"in_place": "copies tensors into the in-process engine's model",
                "disk": "has servers reload an HF folder",
                "broadcast": "broadcasts to the servers' ranks (SGLang's endpoints)",
                "adapters": "has servers load a LoRA adapter folder"}[strategy]
        raise ConfigError(f"rollout.weight_sync.strategy={strategy} {what}, which "
                          f"rollout.engine={r.engine} does not take: use "
                          f"{' or '.join(allowed)} (or auto)")
    if strategy == "adapters" and not (cfg.model.lora.enabled and cfg.model.hf_path):
        raise ConfigError("rollout.weight_sync.strategy=adapters sends a LoRA policy's adapters "
                          "alone to servers that serve the base from model.hf_path: set "
                          "model.lora.rank and model.hf_path (an HF folder with the weights), "
                          "or another strategy")
    if (strategy == "adapters" and r.engine == "vllm"
            and cfg.model.lora.rank > VLLM_LORA_RANKS[-1]):
        raise ConfigError(f"model.lora.rank={cfg.model.lora.rank}: vLLM serves LoRA adapters up "
                          f"to rank {VLLM_LORA_RANKS[-1]}; use rollout.weight_sync.strategy=disk")


def _check_lora(cfg: Config) -> None:
    """Adapters sit on the local layer spec's parallel linear layers (models/lora.py), outside
    sequence parallelism."""
    if cfg.model.transformer_impl == "transformer_engine":
        raise ConfigError("model.lora: adapters sit on the local layer spec's linear layers, "
                          "which model.transformer_impl=transformer_engine replaces: use "
                          "model.transformer_impl=local (or auto)")
    if cfg.parallel.sequence_parallel:
        raise ConfigError("model.lora: adapters under parallel.sequence_parallel are not "
                          "supported: set parallel.sequence_parallel=false")


def _check_tools(cfg: Config) -> None:
    """Multi-turn rollouts with tools: what they cannot do."""
    r = cfg.rollout
    if r.routing_replay == "rollout":
        raise ConfigError("rollout.routing_replay=rollout replays the engine's routing of one "
                          "generation, which a multi-turn response (rollout.tools.names) does "
                          "not have: use rollout.routing_replay=recompute")
    if r.tools.branching.enabled and r.tools.branching.initial_samples > r.n_samples:
        raise ConfigError(f"rollout.tools.branching.initial_samples="
                          f"{r.tools.branching.initial_samples} is more than rollout.n_samples="
                          f"{r.n_samples}")


def _check_engine_old_logprobs(cfg: Config) -> None:
    """algorithm.old_logprobs=engine: what it needs, and what needs the recompute it skips."""
    a, r = cfg.algorithm, cfg.rollout
    if r.engine != "inprocess":
        raise ConfigError(f"algorithm.old_logprobs=engine needs the engine's entropy of every "
                          f"sampled token, which only rollout.engine=inprocess reports "
                          f"(rollout.engine={r.engine}): use algorithm.old_logprobs=recompute")
    if a.rollout_correction.mode != "none":
        raise ConfigError(f"algorithm.rollout_correction.mode={a.rollout_correction.mode} "
                          "weighs the actor's recompute against the engine's log-probs, which "
                          "algorithm.old_logprobs=engine does not compute: use "
                          "algorithm.old_logprobs=recompute or rollout_correction.mode=none")
    if r.routing_replay != "none":
        raise ConfigError(f"rollout.routing_replay={r.routing_replay} replays the routing the "
                          "actor's recompute records, which algorithm.old_logprobs=engine does "
                          "not run: use algorithm.old_logprobs=recompute")
