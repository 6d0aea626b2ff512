"""The config tree's schema: one ``Settings`` dataclass per section, composed into ``Config``.

A field's type is the schema, its metadata holds its bounds and help, and the section's
``validate`` its rules between fields. The components own their sections: ``algorithm`` is the
policy loss's ``PolicyLossSettings`` (plus the actor's keys and the entropy methods'
sections), ``algorithm.token_rules``, ``.rollout_correction`` and ``.entropy_control`` are the
algorithms' settings classes, ``study`` the study's (config/study.py); the trainer, optimizer
and actor take the ``trainer`` section itself. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

from megatron_entropy.algorithms.entropy_control import EntropyControlSettings, EntropyController
from megatron_entropy.algorithms.method_settings import EntropyMethodSections
from megatron_entropy.algorithms.settings import (AdvantageName, PolicyLossSettings,
                                                  RolloutCorrectionSettings, TokenRuleSettings,
                                                  check_token_rules)
from megatron_entropy.config.evaluation import EvalConfig
from megatron_entropy.config.study import StudyConfig
from megatron_entropy.models.lora_settings import LoraSettings
from megatron_entropy.runtime.dtypes import DTYPE_ALIASES, DtypeName
from megatron_entropy.settings import SettingError, Settings
from megatron_entropy.settings import setting as _f  # a field with bounds and help
from megatron_entropy.config.tools import ToolSettings


@dataclass
class ModelConfig(Settings):
    hf_path: str = _f("", help="HF folder: config.json, tokenizer files and (optionally) weights")
    megatron_ckpt: Optional[str] = _f(None, help="dist checkpoint from tools/convert_hf_to_"
                                                 "mcore.py; if null, weights are read from hf_path")
    dtype: DtypeName = _f("bf16", aliases=DTYPE_ALIASES,
                          help="the trained model's weights and compute (bf16/fp16 keep fp32 "
                               "main weights)")
    transformer_impl: Literal["auto", "local", "transformer_engine"] = _f(
        "auto", help="auto: Transformer Engine when installed with CUDA, else the local spec")
    recompute_activations: bool = _f(False, help="recompute every layer's activations in the "
                                                 "backward: less memory, one more forward")
    seq_length: int = _f(4096, ge=16, help="the longest sequence the model is built for; must "
                                           "hold rollout.max_prompt_tokens + max_new_tokens")
    moe_aux_loss_coeff: Optional[float] = _f(
        None, ge=0, help="mixture of experts: weight of the router's load-balancing loss (over "
                         "real tokens; mean over layers, token-weighted mean over "
                         "micro-batches); null = the HF config's router_aux_loss_coef, 0 = none")
    moe_z_loss_coeff: float = _f(0.0, ge=0, help="mixture of experts: weight of the router's "
                                                 "z-loss (over real tokens, as the load-balancing "
                                                 "loss; 0 = none)")
    lora: LoraSettings = _f(default_factory=LoraSettings)


@dataclass
class ParallelConfig(Settings):
    tensor: int = _f(1, ge=1, help="tensor-parallel size (TP): each layer split over this many "
                                   "ranks")
    pipeline: int = _f(1, ge=1, help="pipeline-parallel size (PP): the layers split into this "
                                     "many stages")
    context: int = _f(1, ge=1, help="context parallelism (CP): sequences split over this many ranks")
    expert: int = _f(1, ge=1, help="expert parallelism (mixture of experts): the experts are "
                                   "split over this many data- x context-parallel ranks")
    sequence_parallel: bool = _f(False, help="GPU with Transformer Engine only")
    backend: Literal["auto", "nccl", "gloo"] = _f(
        "auto", help="auto: nccl where CUDA is, else gloo (under Slurm a task without a visible "
                     "GPU is an error: CPU runs say gloo)")
    timeout_minutes: float = _f(30.0, gt=0, help="minutes a collective may wait for the other "
                                                 "ranks before the run fails")
    socket_ifname: Optional[str] = _f(
        None, help="network interface(s) of NCCL's and gloo's sockets, set as NCCL_SOCKET_IFNAME "
                   "and GLOO_SOCKET_IFNAME (e.g. ib0, or ^lo,docker0 to exclude); null: the "
                   "libraries' own choice")

    def validate(self) -> None:
        super().validate()
        if self.sequence_parallel and self.tensor == 1:
            raise SettingError("sequence_parallel", "needs parallel.tensor > 1")


@dataclass
class ServerConfig(Settings):
    """Inference servers for rollout.engine = vllm | sglang."""

    urls: list[str] = _f(default_factory=list, help="servers that already run (http://host:port)")
    urls_file: Optional[str] = _f(None, help="file with one URL per line (written by slurm/ "
                                             "scripts)")
    launch: int = _f(0, ge=0, help="number of servers to start ourselves on this node")
    server_python: str = _f("python", help="interpreter of the serving stack's own environment")
    host: str = _f("127.0.0.1", help="address the launched servers listen on")
    base_port: int = _f(30000, ge=1024, le=65535, help="first port tried for launched server k: "
                                                       "base_port + k, or the next free one")
    extra_args: list[str] = _f(default_factory=list, help="extra command-line args for each server")
    startup_timeout_s: float = _f(600.0, gt=0, help="seconds a server gets to answer /health "
                                                    "after its start, and to warm up after it")
    request_timeout_s: float = _f(600.0, gt=0, help="seconds one generation request or control "
                                                    "call may take")
    max_concurrency: int = _f(64, ge=1, help="requests in flight per server")
    max_connections: int = _f(1024, ge=1, help=(
        "open connections to all servers together (one process, one socket each); requests "
        "beyond it wait for one"))
    max_retries: int = _f(3, ge=0, help="tries again of a failed request; restarts of a dead "
                                        "launched server over the run")
    launch_command: list[str] = _f(default_factory=list, help=(
        "replaces the engine's server command; {python} {model} {host} {port} {weight_version} "
        "are filled in"))
    extra_env: list[str] = _f(default_factory=list, help="KEY=VALUE for each launched server")
    dtype: Literal["auto", DtypeName] = _f(
        "bf16", aliases=DTYPE_ALIASES, help="dtype of launched servers (auto: the checkpoint's)")
    max_model_len: int = _f(0, ge=0, help="prompt + response limit of launched servers; 0 = the "
                                          "model's own")
    router_url: Optional[str] = _f(None, help="sglang-router in front of `urls`: generation goes "
                                              "there, weight updates to each of `urls`")
    health_check_interval_s: float = _f(5.0, gt=0, help="probe period of servers with requests "
                                                        "in flight")
    health_timeout_s: float = _f(30.0, gt=0, help="a probe unanswered this long marks a server "
                                                  "dead")
    pause_mode: Literal["retract", "in_place", "abort"] = _f(
        "retract", help="SGLang /pause_generation mode for weight syncs: retract and in_place "
                        "keep other clients' in-flight requests, abort cuts them off")


# The weight-sync strategies (weight_sync/), by the names the classes are registered under.
WeightSyncStrategy = Literal["in_place", "disk", "broadcast", "adapters"]


@dataclass
class WeightSyncConfig(Settings):
    """How the trainer's weights reach the rollout engine after every step (weight_sync/)."""

    strategy: Literal["auto", WeightSyncStrategy] = _f(
        "auto", help="in_place: copied into the in-process engine's model; disk: an HF folder "
                     "that every server reloads (vLLM, SGLang); broadcast: buckets broadcast to "
                     "the servers' ranks over a process group (SGLang); adapters: a LoRA "
                     "policy's adapters alone, a PEFT folder the servers load on their base "
                     "(vLLM, SGLang; model.lora); auto: in_place for rollout.engine=inprocess, else "
                     "disk (each of them sends a LoRA policy's weights with its adapters "
                     "merged in)")
    bucket_mb: int = _f(512, ge=1, help=(
        "tensors a pipeline stage streams at a time (broadcast buckets, and what later stages "
        "relay to the in-process engine); a bigger tensor goes alone"))
    dir: Optional[str] = _f(None, help="disk: the folder the servers read the weights from "
                                       "(default: the run folder's weight_sync/)")
    backend: Literal["nccl", "gloo"] = _f(
        "nccl", help="broadcast: the process group's backend (gloo: CPU tests)")
    master_addr: Optional[str] = _f(
        None, help="broadcast: this node's address as the servers reach it (default: loopback "
                   "when every server is on this node, else the interface routing to the first "
                   "server)")

    def strategy_for(self, engine: str) -> WeightSyncStrategy:
        """``strategy`` with auto resolved for ``rollout.engine``."""
        if self.strategy != "auto":
            return self.strategy
        return "in_place" if engine == "inprocess" else "disk"


@dataclass
class WeightCheckConfig(Settings):
    """Does the engine hold the trainer's weights? A probe at the first contact and after every
    sync, and each step's recompute of the rollout tokens (trainer/weight_check.py)."""

    enabled: bool = _f(True, help="check at the first contact and after every weight sync; stop "
                                  "the run if the engine's log-probs disagree with the actor's")
    prompts: int = _f(8, ge=1, help="probe: the first k training prompts")
    tokens: int = _f(32, ge=1, help="probe: tokens the engine generates per prompt")
    tolerance: Optional[float] = _f(
        None, gt=0, help="largest mean |engine - actor| log-prob (nats) accepted, on the probe "
                         "and on each step's rollout tokens; null = derived from the engine's "
                         "and the actor's dtypes")
    quantile: float = _f(0.99, gt=0, lt=1, help="the high quantile of |engine - actor| per "
                                                "token also held to a tolerance")
    quantile_tolerance: Optional[float] = _f(
        None, gt=0, help="largest accepted value of that quantile (nats); null = derived from "
                         "the dtypes")


@dataclass
class RolloutConfig(Settings):
    # Keys that became part of a section: where they are now (load_config says so).
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "weight_check_prompts": "weight_check.prompts", "weight_check_tokens": "weight_check.tokens",
        "weight_check_tolerance": "weight_check.tolerance"}

    engine: Literal["inprocess", "vllm", "sglang"] = _f(
        "inprocess", help="who generates: the trainer's own ranks (inprocess) or vLLM/SGLang "
                          "servers (rollout.server)")
    n_samples: int = _f(8, ge=1, help="responses per prompt (group size)")
    temperature: float = _f(1.0, gt=0, help="sampling temperature of the training rollouts; the "
                                            "actor's log-probs use it too")
    top_p: float = _f(1.0, gt=0, le=1, help="nucleus sampling of the training rollouts; 1 disables")
    top_k: int = _f(-1, ge=-1, help="-1 disables")
    max_new_tokens: int = _f(1024, ge=1, help="longest response, in tokens")
    max_prompt_tokens: int = _f(1024, ge=1, help="longest prompt, in tokens (longer ones: "
                                                 "data.overlong_prompts)")
    stop: list[str] = _f(default_factory=list, help="strings that end a response")
    stop_token_ids: list[int] = _f(default_factory=list, help="token ids that end a response, "
                                                              "beside the tokenizer's end of "
                                                              "sequence")
    routing_replay: Literal["none", "recompute", "rollout"] = _f(
        "none", help="mixture of experts: recompute = every update forward routes each token to "
                     "the experts the actor's recompute chose (R2); rollout = the recompute and "
                     "every update route each token to the experts the rollout engine chose "
                     "(R3; engine=inprocess only); none = each forward routes afresh (the "
                     "mismatches are logged as moe/routing_mismatch and, with the in-process "
                     "engine, moe/rollout_routing_mismatch)")
    seed: int = _f(0, help="base of every rollout's and validation's sampling seed")
    dtype: DtypeName = _f("fp32", aliases=DTYPE_ALIASES, help="in-process engine's dtype")
    batch_size: int = _f(64, ge=1, help="in-process engine: sequences decoded together")
    kv_cache_gb: float = _f(0.0, ge=0, help="in-process engine: memory its KV cache may take; "
                                            "fewer sequences are decoded together when prompt + "
                                            "max_new_tokens would not fit; 0 = half of the free "
                                            "memory at its start")
    val_n_samples: int = _f(4, ge=1, help="k of pass@1 averaged over k samples")
    val_temperature: float = _f(0.6, ge=0, help="0 = greedy")
    server: ServerConfig = _f(default_factory=ServerConfig)
    weight_sync: WeightSyncConfig = _f(default_factory=WeightSyncConfig)
    weight_check: WeightCheckConfig = _f(default_factory=WeightCheckConfig)
    max_staleness: int = _f(0, ge=0, help="server engines: > 0 generates the next steps' "
                                          "rollouts while a step trains, on weights at most "
                                          "this many updates old (older samples are dropped); "
                                          "0 = synchronous")
    inflight_at_sync: Literal["finish", "abort"] = _f(
        "finish", help="max_staleness > 0: requests in flight at a weight push finish on the "
                       "old weights (finish), or are aborted and resumed on the new weights "
                       "as partial rollouts, each token keeping its version and log-prob "
                       "(abort); a partial sample's staleness is its oldest token's")
    tools: ToolSettings = _f(default_factory=ToolSettings)


@dataclass
class EntropyControlConfig(EntropyControlSettings):
    """A PI controller on log entropy that sets one knob of the loss each step
    (algorithms/entropy_control.py); the knob starts at its value in the algorithm section."""

    enabled: bool = _f(False, help="run the controller; off, the knob keeps its configured value")

    def validate(self) -> None:
        if self.enabled:  # off: its settings are not used, so their rules are not checked
            super().validate()


@dataclass
class AlgorithmConfig(EntropyMethodSections, PolicyLossSettings):
    """The policy loss's settings (algorithms/settings.py), the entropy methods' sections
    (algorithms/method_settings.py), the advantage and the actor's log-prob and Cov keys."""

    advantage: AdvantageName = _f("grpo", help="the advantage estimator (algorithms/advantages.py)")
    norm_adv_by_std: bool = _f(True, help="GRPO: divide by the group std (+1e-6)")
    cov_scope: Literal["micro_batch", "global"] = _f(
        "micro_batch", help="micro_batch = paper code/verl; global = the whole optimizer step")
    old_logprobs: Literal["recompute", "engine"] = _f(
        "recompute", help="the log-probs the PPO ratio divides by, and the sampling policy's "
                          "entropies: recompute = the actor's own, from a forward-only pass over "
                          "the step's tokens before the update (the first mini-batch's from its "
                          "own update's forward where nothing reads them earlier: "
                          "docs/performance.md); engine = the in-process engine's own "
                          "of the tokens it sampled, no extra forward (equal up to rounding when "
                          "it samples in the actor's dtype; no rollout/logprob_drift, per-step "
                          "weight check of the rollouts or rollout correction, which compare the "
                          "two; the weight check after each sync still runs)")
    global_selection_logprobs: Literal["recompute", "fresh"] = _f(
        "recompute", help="global scope: select with the old-logprob recompute (free) or with a "
                          "forward-only pass of the current policy per mini-batch (exact, +1 fwd)")
    logprob_impl: Literal["chunked", "fused"] = _f(
        "fused", help="fused: log-prob and entropy computed with the output layer, chunk by "
                      "chunk, no full logits; chunked: from the model's logits")
    logprob_chunk_tokens: int = _f(1024, ge=1, help="tokens per chunk of the log-prob and entropy "
                                                    "computation (peak memory)")
    entropy_control: EntropyControlConfig = _f(default_factory=EntropyControlConfig)
    token_rules: TokenRuleSettings = _f(default_factory=TokenRuleSettings)
    rollout_correction: RolloutCorrectionSettings = _f(default_factory=RolloutCorrectionSettings)

    def validate(self) -> None:
        super().validate()
        try:
            check_token_rules(self.token_rules, self)
        except SettingError as e:
            raise SettingError(f"token_rules.{e.setting}", e.message) from None
        self.check_entropy_control()

    def check_entropy_control(self, vocab_size: Optional[int] = None) -> None:
        """The controller's checks against the loss and the knob's starting value here and,
        given ``vocab_size`` (once the model is known), an absolute target against log V."""
        c = self.entropy_control
        if not c.enabled:
            return
        try:
            c.check(self.cov_rule or self.loss, vocab_size)
            EntropyController(c, getattr(self, c.knob))
        except SettingError as e:
            raise SettingError(f"entropy_control.{e.setting}", e.message) from None


@dataclass
class ArithmeticConfig(Settings):
    """The synthetic multi-step integer arithmetic task for CPU runs."""

    num_train: int = _f(20000, ge=1, help="training problems")
    num_val: int = _f(64, ge=1, help="validation problems")
    min_ops: int = _f(1, ge=1, help="fewest operations in a problem")
    max_ops: int = _f(2, ge=1, help="most operations in a problem")
    max_operand: int = _f(20, ge=1, help="numbers are drawn from 1 to it")
    seed: int = _f(0, help="seed of the generated problems")

    def validate(self) -> None:
        super().validate()
        if self.min_ops > self.max_ops:
            raise SettingError("min_ops", f"{self.min_ops} must be <= max_ops ({self.max_ops})")


def _check_terms(task: Settings) -> None:
    if task.min_terms > task.max_terms:
        raise SettingError("min_terms", f"{task.min_terms} must be <= max_terms "
                                        f"({task.max_terms})")


@dataclass
class SumsConfig(Settings):
    """The study task: sums of several numbers, whose worked solutions may add the terms in any
    order and two to four numbers a line (megatron_entropy/data/sums.py)."""

    num_train: int = _f(20000, ge=1, help="training problems")
    num_val: int = _f(128, ge=1, help="validation problems")
    min_terms: int = _f(3, ge=2, help="fewest numbers in a sum")
    max_terms: int = _f(5, ge=2, help="most numbers in a sum")
    max_operand: int = _f(20, ge=1, help="numbers are drawn from 1 to it")
    subtract_prob: float = _f(0.0, ge=0, le=1, help="chance that a term after the first is "
                                                   "subtracted")
    seed: int = _f(0, help="seed of the generated problems")

    def validate(self) -> None:
        super().validate()
        _check_terms(self)


@dataclass
class HintedConfig(Settings):
    """The two-mode study task: sums with a guess of the total, solved by taking the guess
    (right with probability guess_right) or by working the sum out
    (megatron_entropy/data/hinted.py)."""

    num_train: int = _f(20000, ge=1, help="training problems")
    num_val: int = _f(256, ge=1, help="validation problems")
    num_test: int = _f(512, ge=0, help="problems of the test split (megatron-entropy eval); "
                                       "disjoint from train and validation")
    min_terms: int = _f(3, ge=2, help="fewest numbers in a sum")
    max_terms: int = _f(4, ge=2, help="most numbers in a sum")
    max_operand: int = _f(20, ge=1, help="numbers are drawn from 1 to it")
    guess_right: float = _f(0.6, ge=0, le=1, help="chance that the guess is the total")
    guess_error: Literal["ten", "random"] = _f(
        "random", help="how far a wrong guess is off: by 10 up or down (its last digit matches), "
                    "or by a random 1 to 10 up or down (setting it right takes the exact total)")
    seed: int = _f(0, help="seed of the generated problems")

    def validate(self) -> None:
        super().validate()
        _check_terms(self)


@dataclass
class ChainLengthMode(Settings):
    """One mode of the chains task's number of additions: log-normal, drawn by weight."""

    median: float = _f(32.0, gt=0, help="median number of additions (~12.5 tokens each)")
    sigma: float = _f(0.55, ge=0, help="spread: the standard deviation of its log")
    weight: float = _f(1.0, gt=0, help="relative chance of this mode")


@dataclass
class ChainsConfig(Settings):
    """The long-response task: add a step to a start, N times, one line an addition, N drawn
    from a mixture of log-normal modes (megatron_entropy/data/chains.py)."""

    num_train: int = _f(20000, ge=1, help="training problems")
    num_val: int = _f(64, ge=1, help="validation problems")
    length_modes: list[ChainLengthMode] = _f(
        default_factory=lambda: [ChainLengthMode()], help="the modes of the number of "
        "additions; the default (median 32, sigma 0.55) gives responses of median ~400 tokens "
        "with a tail to ~2,000")
    min_steps: int = _f(8, ge=1, help="fewest additions")
    max_steps: int = _f(160, ge=1, help="most additions")
    max_start: int = _f(99, ge=1, help="the start is drawn from 1 to it")
    max_step: int = _f(9, ge=1, help="the step added is drawn from 1 to it")
    num_test: int = _f(0, ge=0, help="problems of the test split (megatron-entropy eval); "
                                     "disjoint from train and validation; 0 = none")
    guess_right: Optional[float] = _f(
        None, ge=0, le=1, help="each question ends with a guess of its answer, right with this "
        "chance (as data.hinted.guess_right): the long two-mode task, answered by boxing the "
        "guess or by working the chain; null = no guess")
    guess_error: Literal["ten", "random"] = _f(
        "random", help="how far a wrong guess is off (as data.hinted.guess_error)")
    seed: int = _f(0, help="seed of the generated problems")

    def validate(self) -> None:
        super().validate()
        if self.min_steps > self.max_steps:
            raise SettingError("min_steps", f"{self.min_steps} must be <= max_steps "
                                            f"({self.max_steps})")
        if not self.length_modes:
            raise SettingError("length_modes", "give at least one mode")


@dataclass
class DataConfig(Settings):
    train_files: list[str] = _f(default_factory=list, help="jsonl/parquet; empty = synthetic task")
    task: Literal["arithmetic", "sums", "hinted", "chains"] = _f(
        "arithmetic", help="the synthetic task without train_files: data.arithmetic, data.sums, "
                           "data.hinted or data.chains")
    val_files: list[str] = _f(default_factory=list, help="jsonl/parquet validation files; empty "
                                                         "with train_files = no validation")
    prompt_key: str = _f("prompt", help="field of a row holding the prompt (dotted: nested)")
    answer_key: str = _f("answer", help="field holding the reference answer the reward checks")
    source_key: str = _f("data_source", help="field naming the row's data source (per-source "
                                             "metrics; rewards may read it)")
    apply_chat_template: bool = _f(True, help="render prompts with the tokenizer's chat template")
    prompt_suffix: str = _f("default", help="'default' = the paper's \\boxed{} instruction; '' = "
                                            "none")
    overlong_prompts: Literal["drop", "truncate_left", "error"] = _f(
        "drop", help="prompts over rollout.max_prompt_tokens: drop them, keep their last tokens, "
                     "or stop with an error naming the row")
    shuffle: bool = _f(True, help="a new order of the training prompts each epoch")
    seed: int = _f(0, help="seed of the training prompts' order")
    prompts_per_step: int = _f(256, ge=1, help="prompts per RL step (each gets rollout.n_samples "
                                               "responses)")
    dynamic_sampling: bool = _f(True, help="drop groups whose rewards are all equal and refill")
    max_refill_rounds: int = _f(3, ge=0, help="dynamic sampling: rounds of more prompts to "
                                              "replace dropped groups; then the step trains on "
                                              "what it has")
    arithmetic: ArithmeticConfig = _f(default_factory=ArithmeticConfig)
    sums: SumsConfig = _f(default_factory=SumsConfig)
    hinted: HintedConfig = _f(default_factory=HintedConfig)
    chains: ChainsConfig = _f(default_factory=ChainsConfig)

    def split_problem(self, split: str) -> Optional[str]:
        """Why this data has no ``split`` ("train", "val" or "test"), or None: only the
        generated problems of data.task hinted, and of chains with data.chains.num_test, have a
        test split."""
        if split != "test" or not self.train_files and (
                self.task == "hinted" or self.task == "chains" and self.chains.num_test):
            return None
        what = ("data.train_files" if self.train_files else "data.chains.num_test=0"
                if self.task == "chains" else f"data.task={self.task!r}")
        return f"{what} has no test split: give test files (eval.files) or eval.split=val"


@dataclass
class RewardConfig(Settings):
    """The reward of every response (megatron_entropy/rewards/)."""

    function: str = _f("math", help="a registered reward (math), package.module:function or "
                                    "path/to/file.py:function")
    workers: int = _f(1, ge=0, help="processes that score in parallel; 0 or 1 = in the process "
                                    "that generated the responses")
    timeout_s: float = _f(10.0, gt=0, help="limit of one call (one response; batched: one "
                                           "list); an overrun, like an exception, gives "
                                           "failure_value. A rule-based check takes "
                                           "milliseconds; raise it for a slow or batched one")
    failure_value: float = _f(0.0, help="the reward of a response whose call failed")
    max_consecutive_failures: int = _f(
        256, ge=0, help="stop the run when this many responses in a row got failure_value (a "
                         "reward that always fails trains on nothing); 0 = never stop")
    max_consecutive_timeouts: int = _f(
        10, ge=0, help="stop the run when this many calls in a row overran timeout_s (a reward "
                        "that hangs would cost timeout_s per response); 0 = never stop")
    overlong_buffer: int = _f(0, ge=0, help="DAPO's overlong shaping: a training response in "
                                            "the last overlong_buffer tokens before rollout."
                                            "max_new_tokens loses reward linearly, up to "
                                            "overlong_penalty at the limit; 0 = off")
    overlong_penalty: float = _f(1.0, ge=0, help="the overlong shaping's penalty at the limit")


@dataclass
class TrainerConfig(Settings):
    steps: int = _f(100, ge=1, help="RL steps of the run (rollout + update each)")
    lr: float = _f(1e-6, gt=0, help="peak learning rate (Adam)")
    min_lr: float = _f(0.0, ge=0, help="cosine schedule: the rate it decays to")
    lr_schedule: Literal["constant", "cosine"] = _f(
        "constant", help="after warm-up: constant at lr, or cosine from lr to min_lr over the "
                         "run's optimizer steps")
    warmup_steps: int = _f(0, ge=0, help="optimizer steps of linear warm-up from 0 to lr")
    weight_decay: float = _f(0.1, ge=0, help="AdamW's decoupled weight decay")
    grad_clip: float = _f(1.0, ge=0, help="0 disables")
    adam_beta1: float = _f(0.9, ge=0, lt=1, help="Adam's first-moment decay")
    adam_beta2: float = _f(0.999, ge=0, lt=1, help="Adam's second-moment decay")
    adam_eps: float = _f(1e-8, gt=0, help="Adam's denominator epsilon")
    mini_batches_per_step: int = _f(1, ge=1, help="optimizer steps per rollout batch (per epoch)")
    ppo_epochs: int = _f(1, ge=1, help="passes over each step's rollouts")
    micro_batch_tokens: int = _f(16384, ge=1, help="token budget of one micro-batch (dynamic "
                                                   "bsz; under CP over its CP ranks)")
    micro_batch_layout: Literal["auto", "padded", "shared_prompt", "packed"] = _f(
        "auto", help="rows of a micro-batch (the same function up to rounding): 'padded' one per "
                     "sample; 'shared_prompt' a prompt once and its responses (local spec, no CP); "
                     "'packed' samples back to back, each seeing itself (local spec or TE); 'auto' "
                     "= packed or shared_prompt, the cheaper per mini-batch (MoE: packed)")
    distributed_optimizer: Union[bool, Literal["auto"]] = _f(
        "auto", help="Megatron's distributed optimizer: fp32 main weights and Adam moments "
                     "sharded over DP (x CP) ranks; 'auto' = on where DP x CP > 1")
    overlap_communication: Union[bool, Literal["auto"]] = _f(
        "auto", help="overlap the DP grad reduce with the backward (bucket by bucket) and, with "
                     "the distributed optimizer, the param all-gather with the next forward; "
                     "'auto' = on GPUs (NCCL). Same update either way")
    seed: int = _f(42, help="seed of torch's and Megatron's RNGs and of the update's draws "
                                  "(Clip-Cov)")
    save_interval: int = _f(0, ge=0, help="steps between checkpoints; 0 = only at the end")
    keep_last: int = _f(2, ge=1, help="checkpoints kept; older ones are deleted")
    resume: str = _f("auto", aliases={"None": "none", "NONE": "none", "Auto": "auto"},
                     help="'auto' (latest in the run dir), 'none', or a checkpoint: its folder, "
                          "a checkpoints/ folder (its latest) or a run folder")
    val_interval: int = _f(0, ge=0, help="steps between validations; 0 = never")
    val_before_train: bool = _f(False, help="validate once before the first step")
    exit_duration_minutes: float = _f(0.0, ge=0, help=(
        "checkpoint and exit 75 (to be requeued) before this many minutes since the start would "
        "be passed; 0 = no limit of its own. Under Slurm the job's end time is always one"))
    exit_margin_s: float = _f(60.0, ge=0, help=(
        "seconds kept free before that end, beyond the longest recent step and a checkpoint"))

    def validate(self) -> None:
        super().validate()
        if self.min_lr > self.lr:
            raise SettingError("min_lr", f"{self.min_lr} must be <= lr ({self.lr})")

    @property
    def total_updates(self) -> int:
        """Optimizer steps of the whole run: the learning-rate schedule's length."""
        return self.steps * self.ppo_epochs * self.mini_batches_per_step

    def uses_overlap(self, on_gpu: bool) -> bool:
        """``overlap_communication`` resolved: 'auto' is on where the collectives run on GPUs
        (on gloo they run on the same cores as the compute, so there is nothing to hide them
        behind)."""
        return on_gpu if self.overlap_communication == "auto" else bool(self.overlap_communication)

    def uses_distributed_optimizer(self, data_parallel: int) -> bool:
        """``distributed_optimizer`` resolved: 'auto' is on where there is more than one rank to
        shard over (``data_parallel``: DP x CP, the ranks Megatron shards the state over)."""
        return data_parallel > 1 if self.distributed_optimizer == "auto" \
            else bool(self.distributed_optimizer)


@dataclass
class LoggingConfig(Settings):
    name: str = _f("run", help="the run's folder under runs_dir (and its wandb name)")
    runs_dir: str = _f("runs", help="folder of the run folders")
    progress_bar: bool = _f(True, help="rank 0 prints a progress bar with the step's metrics")
    tensorboard: bool = _f(False, help="also write TensorBoard events to the run's tensorboard/")
    wandb: bool = _f(False, help="also log to Weights & Biases")
    wandb_project: str = _f("megatron-entropy", help="the wandb project")


@dataclass
class ClusterConfig(Settings):
    """The job's shape on a Slurm cluster: read by slurm/ scripts and `megatron-entropy plan`."""

    gpus_per_node: int = _f(8, ge=1, help="the trainer runs one task per GPU (CPU nodes: per slot)")
    gpu_memory_gb: float = _f(80.0, gt=0, help="memory of one GPU, for the plan's fit check")
    server_nodes: int = _f(0, ge=0, help="rollout servers on the job's first K nodes, the trainer "
                                         "on the rest; 0 = servers share the first trainer node")
    server_gpus: int = _f(1, ge=1, help="GPUs of one rollout server (its tensor parallel size)")
    servers_per_node: int = _f(0, ge=0, help="0 = gpus_per_node // server_gpus on server nodes, "
                                             "1 when servers share a trainer node")


@dataclass
class AnalysisConfig(Settings):
    entropy_change: bool = _f(False, help=(
        "after each step's updates, score its response tokens again with the new weights (one "
        "forward-only pass) and log entropy/delta = H_after - H_before beside cov/step"))
    entropy_lemma: bool = _f(False, help=(
        "per response token of each step's first mini-batch: the entropy change over its "
        "optimizer step against the lemma's -Cov(log pi, dz) over the vocabulary, from the "
        "logits before and after (two forward-only passes); logs lemma/*"))


@dataclass
class Config(Settings):
    # Keys that moved, still accepted: old dotted key -> (new dotted key, old value -> new).
    # load_config moves each one it finds and records one line about it (``deprecations``).
    RENAMED_KEYS: ClassVar[dict[str, tuple[str, dict[Any, Any]]]] = {
        "rollout.weight_sync_bucket_mb": ("rollout.weight_sync.bucket_mb", {}),
        "rollout.server.weight_sync": ("rollout.weight_sync.strategy",
                                       {"distributed": "broadcast"}),
        "rollout.server.weight_sync_dir": ("rollout.weight_sync.dir", {}),
        "rollout.server.weight_sync_backend": ("rollout.weight_sync.backend", {}),
        "rollout.server.weight_sync_master_addr": ("rollout.weight_sync.master_addr", {})}
    # What load_config said about the keys it moved (not a config key).
    deprecations: ClassVar[tuple[str, ...]] = ()

    model: ModelConfig = _f(default_factory=ModelConfig)
    parallel: ParallelConfig = _f(default_factory=ParallelConfig)
    rollout: RolloutConfig = _f(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = _f(default_factory=AlgorithmConfig)
    data: DataConfig = _f(default_factory=DataConfig)
    reward: RewardConfig = _f(default_factory=RewardConfig)
    trainer: TrainerConfig = _f(default_factory=TrainerConfig)
    logging: LoggingConfig = _f(default_factory=LoggingConfig)
    cluster: ClusterConfig = _f(default_factory=ClusterConfig)
    analysis: AnalysisConfig = _f(default_factory=AnalysisConfig)
    study: StudyConfig = _f(default_factory=StudyConfig)
    eval: EvalConfig = _f(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.runs_dir) / self.logging.name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
