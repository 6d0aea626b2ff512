"""Let megatron-core run without CUDA (CPU machines, CI) — active only when CUDA is absent.

megatron-core allocates with ``device=torch.cuda.current_device()`` or ``device="cuda"``, reads and
writes the CUDA RNG state, synchronises CUDA streams and asserts ``torch.cuda.FloatTensor`` grads.
On a machine without CUDA each of these raises. This layer redirects them to the CPU:

* ``torch.cuda.current_device`` -> ``torch.device("cpu")``; ``synchronize``/``empty_cache`` no-ops;
  streams and events are inert; the CUDA RNG API maps to the CPU default generator, so Megatron's
  model-parallel RNG tracker forks the CPU generator exactly as it forks the CUDA one on a GPU;
  ``Tensor.cuda()`` returns the tensor unchanged.
* In the megatron modules that spell ``device="cuda"`` literally, the module's ``torch`` name is
  replaced by a proxy whose tensor factories map "cuda" to "cpu".
* ``clip_grad_by_total_norm_fp32`` asserts a CUDA grad type; it is replaced by the same computation
  without that assertion.
* MoE: the all-to-all token dispatcher creates a CUDA stream for its device-to-host copies (inert
  here, the copies are host copies already), and without Transformer Engine 0.16's router gating
  reads a ``te_general_gemm`` name its failed import never bound: it is bound to None, which
  selects the plain torch matmul the function has for that case. The dispatcher's "device to
  host" step (``maybe_move_tensor_to_cpu``) only acts on CUDA tensors, so its all-to-all split
  sizes would stay tensors, which ``all_to_all_single`` refuses: on the CPU it returns the numpy
  arrays it returns on a GPU.

The layer was written against the megatron-core versions in ``SUPPORTED_MEGATRON_VERSIONS``; any other
version raises instead of half-working. It is never applied when CUDA is available, so nothing here
touches the GPU path; only the trainer's distributed start-up applies it (checkpoint conversion
needs none of it and runs with any megatron-core).
"""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any

import megatron.core
import torch

SUPPORTED_MEGATRON_VERSIONS = ("0.16",)

# Modules of megatron.core that spell device="cuda" (or 'cuda') literally.
_LITERAL_CUDA_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.utils",
    "megatron.core.transformer.moe.moe_utils",  # the aux-loss tracker's buffers
    # context parallelism: each CP rank's rotary positions (a pinned index tensor)
    "megatron.core.models.common.embeddings.rope_utils",
)

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor")

_applied = False


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):
        return "cpu"
    return device


def _cpu_factory(fn):
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    wrapped.__name__ = fn.__name__
    return wrapped


class _CpuTorch(types.ModuleType):
    """Stand-in for ``torch`` inside one megatron module: everything is torch's, except that the
    tensor factories place "cuda" tensors on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _InertStream:
    """A CUDA stream/event stand-in: every method is a no-op that returns another inert stand-in
    (``stream.record_event().synchronize()`` works, as the MoE dispatcher calls it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: _InertStream()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    # Same as megatron's version, minus its assertion that grads are torch.cuda.FloatTensor.
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = param.decoupled_grad if use_decoupled_grad else param.grad
        if grad is not None:
            grads.append(grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.mul_(clip_coeff)


def _host_tensor(tensor, as_numpy: bool = False, record_stream: bool = False):
    # megatron's maybe_move_tensor_to_cpu for tensors that are on the host already.
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _with_cuda_type_names(init):
    """Megatron's mixed-precision and distributed optimizers choose each parameter's path (fp32
    main copy or not) by its ``type()`` string, spelled ``torch.cuda.*``, and raise on any other.
    While ``init`` runs, a CPU tensor's ``type()`` answers with the CUDA spelling."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        original = torch.Tensor.type

        def cuda_type_name(self, *a: Any, **k: Any) -> Any:
            name = original(self, *a, **k)
            return name if a or k else _CUDA_TYPE_NAMES.get(name, name)

        torch.Tensor.type = cuda_type_name
        try:
            return init(*args, **kwargs)
        finally:
            torch.Tensor.type = original

    wrapped.__name__ = init.__name__
    return wrapped


def _with_adam_steps_before_load(sharded_state_dict):
    """Without apex/TE the distributed optimizer reads Adam's ``step`` from torch's per-parameter
    state, which torch creates only at the first step: a fresh optimizer about to load has none.
    Give it zero moments and steps (the load replaces them), as the fused optimizers' own
    initialisation does."""

    def wrapped(self, model_sharded_state_dict, is_loading: bool = False, **kwargs: Any) -> Any:
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
            for state in self.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))
        return sharded_state_dict(self, model_sharded_state_dict, is_loading, **kwargs)

    return wrapped


def _keeping_adam_step(set_states):
    """The fully reshardable load hands each parameter its main weight and moments but not
    torch Adam's ``step`` (set from the common state beforehand), then copies every key of the
    parameter's state: keep the step it already has."""

    def wrapped(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)

    return wrapped


def _with_own_adam_steps(load_state_dict):
    """Without apex/TE the distributed optimizer's load gives every parameter's torch Adam state
    one and the same ``step`` tensor. Torch's Adam increments each parameter's step in place, so
    a shared one advanced by the number of parameters per update, and the resumed run's bias
    corrections were wrong from its first step. Each parameter gets its own copy."""

    def wrapped(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    return wrapped


def _check_version() -> None:
    version = megatron.core.__version__
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_MEGATRON_VERSIONS):
        raise RuntimeError(
            f"megatron-entropy's CPU compatibility layer supports megatron-core "
            f"{', '.join(v + '.x' for v in SUPPORTED_MEGATRON_VERSIONS)}, but {version} is installed. "
            "On a CPU machine install megatron-core==0.16.1 (pip install -e . does); on a GPU "
            "machine this layer is not used."
        )


def apply() -> bool:
    """Install the CPU redirections if CUDA is absent. Returns True when the layer is active.

    Idempotent; a no-op (returns False) on a machine with CUDA.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    _check_version()

    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.current_stream = lambda *a, **k: _InertStream()
    cuda.default_stream = lambda *a, **k: _InertStream()
    cuda.Stream = _InertStream
    cuda.Event = _InertStream
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    torch.Tensor.cuda = lambda self, *a, **k: self

    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )

    proxy = _CpuTorch()
    for name in _LITERAL_CUDA_MODULES:
        importlib.import_module(name).torch = proxy

    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    importlib.import_module("megatron.core.transformer.moe.token_dispatcher") \
        .maybe_move_tensor_to_cpu = _host_tensor

    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32

    distrib_optimizer = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    for cls in (optimizer.Float16OptimizerWithFloat16Params,
                distrib_optimizer.DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    # CPU machines have neither apex nor TE, so the distributed optimizer runs on torch's Adam.
    opt_cls = distrib_optimizer.DistributedOptimizer
    opt_cls.sharded_state_dict = _with_adam_steps_before_load(opt_cls.sharded_state_dict)
    opt_cls._set_main_param_and_optimizer_states = _keeping_adam_step(
        opt_cls._set_main_param_and_optimizer_states)
    opt_cls.load_state_dict = _with_own_adam_steps(opt_cls.load_state_dict)

    _applied = True
    return True
