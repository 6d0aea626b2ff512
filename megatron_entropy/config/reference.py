"""The reference of every config key, generated from the settings classes themselves: each
section of ``Config`` and its keys with their type or choices, default, bounds, other accepted
spellings and help line. ``megatron-entropy config-reference`` prints it; docs/configuration.md
is its output (a unit test keeps the two equal), so a setting is documented where it is defined.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal, Union

from megatron_entropy.config import Config
from megatron_entropy.config.loading import INPUT_PATH_KEYS
from megatron_entropy.settings import Settings, choices, field_types

PAGE = "docs/configuration.md"
COMMAND = f"megatron-entropy config-reference --out {PAGE}"

_INTRO = """\
One YAML file holds a run's config, in the sections below; any key can be overridden on the
command line with its dotted name (`megatron-entropy train CONFIG algorithm.loss=kl_cov
trainer.lr=1e-6`). An unknown key, a wrong type or an out-of-range value stops the run with one
message naming the key (`unknown config key 'algorithm.clip_cov_ration'; did you mean
'algorithm.clip_cov_ratio'?`); keys that depend on each other are checked together when the
config loads. How the sections are composed of the components' settings classes:
[architecture.md](architecture.md#configuration-in-the-code).

Relative paths in a config file that name what a run reads (""" + ", ".join(
    f"`{key}`" for key in INPUT_PATH_KEYS) + """) are taken from the file's folder where they
exist there, else from the working directory: a config copied elsewhere with its model and data
beside it works from any folder, and the examples' paths, written from the checkout's top, work
from there. Outputs (`logging.runs_dir`, `rollout.weight_sync.dir`) and command-line
overrides are relative to the working directory. A path found in neither place is an error that
says where it was looked for."""


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Settings)


def _list_item(tp: Any) -> Any:
    """The element type of ``list[X]``; None for any other type."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


def _value(value: Any) -> str:
    """A value as it is written in YAML (JSON's spelling, which YAML reads)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif isinstance(value, list):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    return json.dumps(value)


def type_name(tp: Any) -> str:
    """A field's type in words: ``int``, ``str or null``, ``list of str``, a Literal's choices."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(f"`{c}`" if isinstance(c, str) else _value(c)
                                     for c in choices(tp))
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        literal = [a for a in args if typing.get_origin(a) is Literal]
        others = [type_name(a) for a in args if typing.get_origin(a) is not Literal]
        parts = ([type_name(Literal[tuple(c for a in literal for c in choices(a))])]
                 if literal else []) + others
        return " or ".join(parts)
    item = _list_item(tp)
    if item is not None:
        return f"list of {type_name(item)}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _bounds(meta: typing.Mapping[str, Any]) -> str:
    symbols = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
    return ", ".join(f"{symbol} {meta[key]:g}" for key, symbol in symbols
                     if meta.get(key) is not None)


def _doc(cls: type) -> str:
    """A class's own docstring (not the signature dataclasses writes for one without)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _sections(cls: type, path: str, help_text: str) -> Iterator[tuple[str, type, str]]:
    """(dotted path, class, help) of ``cls`` and every section below it, depth first; a list of
    settings (``study.losses``) is a section of its items, ``path[]``."""
    yield path, cls, help_text
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        tp, item = hints[f.name], _list_item(hints[f.name])
        sub = f"{path}.{f.name}" if path else f.name
        if _is_section(tp):
            yield from _sections(tp, sub, f.metadata.get("help", ""))
        elif _is_section(item):
            yield from _sections(item, sub + "[]", f.metadata.get("help", ""))


def _rows(cls: type, path: str) -> list[str]:
    hints = field_types(cls)
    rows = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            continue
        default = _default(f)
        aliases = f.metadata.get("aliases") or {}
        help_text = f.metadata.get("help", "")
        if aliases:
            also = ", ".join(f"`{a}` = `{v}`" for a, v in aliases.items())
            help_text = f"{help_text} (also accepted: {also})" if help_text else \
                f"also accepted: {also}"
        if _is_section(_list_item(tp)):
            help_text = (help_text + " " if help_text else "") + \
                f"(each item: [`{path}.{f.name}[]`](#{_slug(f'{path}.{f.name}[]')}))"
        shown = "required" if default is dataclasses.MISSING else f"`{_value(default)}`"
        rows.append(f"| `{path}.{f.name}` | {_cell(type_name(tp))} | {_cell(shown)} | "
                    f"{_bounds(f.metadata)} | {_cell(help_text)} |")
    return rows


def _slug(path: str) -> str:
    """GitHub's anchor of a heading `` `path` ``: dots and brackets dropped."""
    return "".join(c for c in path.lower() if c.isalnum() or c in "_-")


def config_reference() -> str:
    """docs/configuration.md: every section and key of ``Config``, from the classes' own
    metadata."""
    sections = [s for s in _sections(Config, "", "") if s[0]]
    out = ["# Configuration reference", "",
           f"Generated from the settings classes' own help text by `{COMMAND}`; do not edit it "
           "by hand: change the setting's `help=` (or the class's docstring) and run that "
           "command again.", "", _INTRO, "",
           "Each key: its type (or the values it takes), its default as written in YAML, its "
           "bounds and what it does.", "", "Sections: " +
           ", ".join(f"[`{p}`](#{_slug(p)})" for p, _, _ in sections), ""]
    for path, cls, help_text in sections:
        out += [f"## `{path}`", ""]
        intro = " ".join(t for t in (_doc(cls), help_text) if t)
        if intro:
            out += [intro, ""]
        rows = _rows(cls, path)
        if rows:
            out += ["| key | type | default | bounds | help |", "| --- | --- | --- | --- | --- |",
                    *rows, ""]
    out += ["## Old names", "", "Still read, each with one warning line, as the key it became "
            "(a value in parentheses is read as the one after the arrow):", "",
            "| old key | read as |", "| --- | --- |"]
    for old, (new, values) in Config.RENAMED_KEYS.items():
        renamed = ", ".join(f"{_value(a)} -> {_value(b)}" for a, b in values.items())
        out.append(f"| `{old}` | `{new}`{f' ({renamed})' if renamed else ''} |")
    return "\n".join(out).rstrip() + "\n"


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help=f"write it to this file (e.g. {PAGE}) instead of "
                                            "printing it")


def _run(args: argparse.Namespace) -> int:
    text = config_reference()
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text)
    return 0


CONFIG_REFERENCE = ("print the reference of every config key (docs/configuration.md)", _add_args,
                    _run)
