"""Reward functions by name or by path: the registry and ``reward.function``'s resolution.

A reward scores one response, ``fn(response, ground_truth) -> float``, or, marked ``batched``, the
whole list at once, ``fn(responses, ground_truths) -> list[float]`` (a reward-model server wants
batches). Either may take the rows' data sources as a keyword parameter (``source=`` /
``sources=``). ``reward.function`` names a registered reward (``math``), a module's function
(``package.module:function``) or a file's (``path/to/file.py:function``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_entropy.config import ConfigError
from megatron_entropy.runtime.files import relative_note

KEY = "reward.function"
_MARK = "__megatron_entropy_reward__"  # the attribute reward_function() sets


@dataclass(frozen=True)
class RewardKind:
    """How a function is called: ``batched`` gets the whole list; ``self_timed`` bounds its own
    time (the math reward kills its checker process), so no timer is set around it in-process."""

    batched: bool = False
    self_timed: bool = False


@dataclass(frozen=True)
class RewardFunction:
    """A resolved ``reward.function``."""

    spec: str  # as configured
    fn: Callable[..., Any]
    kind: RewardKind
    takes_sources: bool  # has the keyword parameter source= (batched: sources=)
    worker_spec: Optional[str]  # what a worker process resolves to get the same function

    def __call__(self, responses: Sequence[str], ground_truths: Sequence[str],
                 sources: Sequence[str]) -> list[float]:
        """One call: a batched function on the lists, a per-response one on their one item.
        Raises RewardResultError for a result that is no reward."""
        if self.kind.batched:
            return self.batch(responses, ground_truths, sources)
        (response,), (truth,), (source,) = responses, ground_truths, sources
        return [self.one(response, truth, source)]

    def one(self, response: str, ground_truth: str, source: str) -> float:
        value = self.fn(response, ground_truth, source=source) if self.takes_sources \
            else self.fn(response, ground_truth)
        return _as_reward(value)

    def batch(self, responses: Sequence[str], ground_truths: Sequence[str],
              sources: Sequence[str]) -> list[float]:
        values = self.fn(list(responses), list(ground_truths), sources=list(sources)) \
            if self.takes_sources else self.fn(list(responses), list(ground_truths))
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise RewardResultError(f"returned {_shown(values)}; a batched reward returns a "
                                    f"list of {len(responses)} numbers")
        if len(values) != len(responses):
            raise RewardResultError(f"returned {len(values)} rewards for {len(responses)} "
                                    "responses")
        return [_as_reward(v) for v in values]


class RewardResultError(ValueError):
    """A reward function returned something that is not a reward (a bug in it, not a bad
    response): the run stops."""


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{text[:80]}{'...' if len(text) > 80 else ''} ({type(value).__name__})"


def _as_reward(value: Any) -> float:
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise RewardResultError(f"returned {_shown(value)}; a reward is a finite number")


def reward_function(*, batched: bool = False, self_timed: bool = False) -> Callable:
    """Decorator: how ``reward.function`` calls this function (see RewardKind). Unmarked
    functions are per-response."""
    def mark(fn: Callable) -> Callable:
        setattr(fn, _MARK, RewardKind(batched, self_timed))
        return fn
    return mark


_REGISTRY: dict[str, Callable] = {}


def register_reward(name: str, *, batched: bool = False, self_timed: bool = False) -> Callable:
    """Decorator: ``reward.function=<name>`` selects this function."""
    def add(fn: Callable) -> Callable:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is registered already ({_REGISTRY[name]!r})")
        _REGISTRY[name] = reward_function(batched=batched, self_timed=self_timed)(fn)
        return fn
    return add


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str) -> Callable:
    """The function registered as ``name``."""
    if name not in _REGISTRY:
        raise KeyError(f"no reward is registered as {name!r} (registered: "
                       f"{', '.join(registered_rewards())})")
    return _REGISTRY[name]


def _load_file(path: str, key: str = KEY) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{key}: the file {path!r} does not exist{relative_note(path)}")
    # One module per file: a second resolution (a worker's, a validation's) finds it loaded.
    name = f"_reward_file_{abs(hash(str(file.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_object(spec: str, key: str = KEY, registered: str = "", noun: str = "function"
                  ) -> Any:
    """What ``package.module:attr`` or ``path/to/file.py:attr`` names (``attr`` may be dotted);
    raises ConfigError naming ``key`` and what failed. ``registered`` says what the registered
    names are (the spec is none of them), ``noun`` what ``attr`` should be, for the message."""
    if registered == "" and key == KEY:
        registered = f"a registered reward (registered: {', '.join(registered_rewards())})"
    where, _, attr = spec.partition(":")
    if not where or not attr:
        raise ConfigError(f"{key}: {spec!r} is neither {registered} nor 'package.module:{noun}' or "
                          f"'path/to/file.py:{noun}'")
    try:
        module = _load_file(where, key) if where.endswith(".py") else importlib.import_module(where)
    except ConfigError:
        raise
    except ModuleNotFoundError as e:
        if e.name is not None and (where == e.name or where.startswith(e.name + ".")):
            raise ConfigError(f"{key}: {spec!r}: module not found ({e})") from None
        raise ConfigError(f"{key}: {spec!r}: importing {where!r} failed "
                          f"({type(e).__name__}: {e})") from None
    except Exception as e:  # noqa: BLE001 - any error while importing the user's module
        raise ConfigError(f"{key}: {spec!r}: importing {where!r} failed "
                          f"({type(e).__name__}: {e})") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{key}: {spec!r}: {where!r} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


def _takes_sources(fn: Callable, kind: RewardKind, spec: str) -> bool:
    """Whether ``fn`` takes the sources keyword; raises if it cannot take the two lists (or the
    response and its ground truth) positionally."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it as documented
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    star = any(p.kind is p.VAR_POSITIONAL for p in params)
    wanted = "(responses, ground_truths[, sources=])" if kind.batched \
        else "(response, ground_truth[, source=])"
    if len(required) > 2 or (len(positional) < 2 and not star):
        raise ConfigError(f"{KEY}: {spec!r} takes ({', '.join(p.name for p in positional)}); a "
                          f"{'batched ' if kind.batched else ''}reward is called as {wanted}")
    keyword = "sources" if kind.batched else "source"
    return any((p.name == keyword and p.kind is not p.POSITIONAL_ONLY)
               or p.kind is p.VAR_KEYWORD for p in params)


def resolve_reward(spec: str) -> RewardFunction:
    """``reward.function`` -> the function and how to call it. Raises ConfigError naming the key
    and what failed: module not found, attribute missing, not callable, wrong signature."""
    spec = spec.strip()
    if spec in _REGISTRY:
        fn = _REGISTRY[spec]
    else:
        fn = import_object(spec)
    if not callable(fn):
        raise ConfigError(f"{KEY}: {spec!r} is {_shown(fn)}, not a function")
    kind = getattr(fn, _MARK, RewardKind())
    if spec in _REGISTRY or not spec.partition(":")[0].endswith(".py"):
        module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        worker_spec = f"{module}:{name}" if module and module != "__main__" \
            and "<locals>" not in name else None
    else:
        where, _, attr = spec.partition(":")
        worker_spec = f"{Path(where).resolve()}:{attr}"
    return RewardFunction(spec, fn, kind, _takes_sources(fn, kind, spec), worker_spec)
