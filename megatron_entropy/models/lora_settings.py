"""``model.lora``: low-rank adapters on the policy's parallel linear layers (models/lora.py).
Torch-free: the config tree loads it without torch."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_entropy.models.arch import UnsupportedModelError
from megatron_entropy.settings import SettingError, Settings
from megatron_entropy.settings import setting as _f

# The Megatron linear layers an adapter can sit on, and the Hugging Face modules each stands for
# (a mixture-of-experts model's linear_fc1/linear_fc2 are its experts', one adapter per expert).
TARGETS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
# The targets a mixture-of-experts model has on its experts.
EXPERT_TARGETS = ("linear_fc1", "linear_fc2")


@dataclass
class LoraSettings(Settings):
    """LoRA: the base weights frozen, W x + (alpha / rank) B A x trained in their place."""

    rank: int = _f(0, ge=0, help="rank of every adapter; 0 = no adapters (every weight trained)")
    alpha: float = _f(32.0, gt=0, help="the adapters' output is scaled by alpha / rank")
    dropout: float = _f(0.0, ge=0, lt=1, help="dropout on an adapter's input while training")
    targets: list[str] = _f(default_factory=lambda: list(TARGETS), help=(
        "the Megatron linear layers that get adapters: linear_qkv (attention q, k, v), "
        "linear_proj (attention output), linear_fc1 (MLP gate and up), linear_fc2 (MLP down); "
        "a mixture-of-experts model's linear_fc1/linear_fc2 are its experts', each expert its "
        "own adapter"))

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        super().validate()
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise SettingError("targets", f"{unknown} are not layers an adapter sits on; choose "
                                          f"from {list(TARGETS)}")
        if self.rank and not self.targets:
            raise SettingError("targets", "is empty: name at least one layer, or set rank 0")


def check_lora_model(lora: LoraSettings, is_moe: bool, tensor: int = 1,
                     adapter_sync: bool = False) -> None:
    """What adapters on this model cannot do, as one line naming the key (the trainer's start
    checks it before any rank starts): a mixture-of-experts model's expert adapters under
    tensor parallelism, or synced alone (``adapter_sync``: PEFT has no per-expert form that
    vLLM or SGLang loads)."""
    experts = [t for t in lora.targets if t in EXPERT_TARGETS] if lora.enabled and is_moe else []
    if experts and tensor > 1:
        raise UnsupportedModelError(
            f"model.lora.targets={experts}: a mixture-of-experts model's expert adapters need "
            f"parallel.tensor=1 (the experts split by parallel.expert), got {tensor}; or leave "
            f"{experts} out of the targets")
    if experts and adapter_sync:
        raise UnsupportedModelError(
            "rollout.weight_sync.strategy=adapters: a mixture-of-experts model's expert "
            "adapters have no PEFT form that vLLM or SGLang loads; use rollout.weight_sync.strategy="
            f"disk (the adapters merged into the weights) or leave {experts} out of "
            "model.lora.targets")
