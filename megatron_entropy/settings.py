"""The settings of one component: a dataclass whose fields carry their choices, bounds and help.

Every config section (``megatron_entropy/config/``) and every pure component's settings class
(``algorithms/``) subclasses ``Settings``. Constructing one maps a field's aliases to its one
spelling, checks each field against the choices of its ``Literal`` type and its bounds
(``setting(..., ge=0)``), then the class's own rules between its fields (``validate``, written
once, in the class that owns the fields). A bad value raises ``SettingError`` naming the field;
the config tree prefixes the section's key path and raises ``ConfigError``. Standard library
only: the pure components, the ground floor (runtime/) and the torch-free config (Slurm helpers,
``plan``) load it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, Literal, Mapping, Optional, Union

_BOUNDS = (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
           ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<"))


class ConfigError(ValueError):
    """A bad config value; the message names the key path. The CLI prints it as one line."""


class SettingError(ValueError):
    """A bad value (or a bad combination) of one setting; ``setting`` is its field name."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
        self.message = message


def setting(default: Any = dataclasses.MISSING, *, ge: Optional[float] = None,
            gt: Optional[float] = None, le: Optional[float] = None, lt: Optional[float] = None,
            help: str = "", aliases: Optional[Mapping[str, str]] = None,
            default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with bounds, other accepted spellings (``aliases``: spelling -> the
    field's own), both applied on construction, and a help line."""
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "help": help, "aliases": aliases or {}}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class Settings:
    """Base of every settings class: fields checked on construction, then ``validate``."""

    def __post_init__(self) -> None:
        hints = field_types(type(self))
        for f in dataclasses.fields(self):
            value = canonical(f, getattr(self, f.name))
            setattr(self, f.name, value)
            check_choice(f.name, value, hints[f.name])
            check_bounds(f.name, value, f.metadata)
        self.validate()

    def validate(self) -> None:
        """The rules between this class's own fields; subclasses extend it (call super())."""


def canonical(f: dataclasses.Field, value: Any) -> Any:
    """``value`` in the field's own spelling (an alias replaced)."""
    aliases = f.metadata.get("aliases", {})
    return aliases[value] if isinstance(value, str) and value in aliases else value


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> dict[str, Any]:
    """The resolved type of each field of a dataclass (cached: resolving is slow)."""
    return typing.get_type_hints(cls)


def choices(tp: Any) -> tuple:
    """The values a ``Literal`` type allows (also inside a ``Union``); () if it has none."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (Union, types.UnionType):
        return tuple(c for arg in typing.get_args(tp) for c in choices(arg))
    return ()


def _other_arm_takes(value: Any, tp: Any) -> bool:
    """``value`` is of a non-Literal member of the union ``tp`` (None for Optional)."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return False
    for arg in typing.get_args(tp):
        if typing.get_origin(arg) is Literal:
            continue
        if arg is type(None) and value is None:
            return True
        if isinstance(arg, type) and arg is not type(None) and isinstance(value, arg):
            return True
    return False


def check_choice(name: str, value: Any, tp: Any) -> None:
    """A field of a ``Literal`` type holds one of its values (a union's other members pass)."""
    allowed = choices(tp)
    if not allowed or value in allowed or _other_arm_takes(value, tp):
        return
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise SettingError(name, f"{value!r} is not allowed; choose one of "
                             f"{', '.join(repr(a) for a in allowed)}{hint}")


def check_bounds(name: str, value: Any, meta: Mapping[str, Any]) -> None:
    if value is None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    for key, ok, symbol in _BOUNDS:
        bound = meta.get(key)
        if bound is not None and not ok(value, bound):
            raise SettingError(name, f"{value!r} is out of range; it must be {symbol} {bound}")
