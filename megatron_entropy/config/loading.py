"""Loading the config tree: YAML file, then a mapping, then dotted command-line overrides.

``load_config`` rejects unknown keys (suggesting the closest one), wrong types and out-of-range
values with a single ConfigError that names the key path, the bad value and what is allowed,
then runs the checks across sections (validation.py).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Hashable, Literal, Optional, Union

import yaml

from megatron_entropy.config.schema import Config
from megatron_entropy.config.validation import validate
from megatron_entropy.settings import (ConfigError, SettingError, canonical, check_choice,
                                       field_types)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if len(errors) == 1 else ConfigError(
            f"{path}: {value!r} is not {_type_name(tp)}")
    if origin is Literal:
        try:
            check_choice(path, value, tp)
        except SettingError as e:
            raise ConfigError(str(e)) from None
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if isinstance(value, bool) and "enabled" in {f.name for f in dataclasses.fields(tp)}:
            raise ConfigError(f"{path} is a section: set {path}.enabled={str(value).lower()}")
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping (section), got {value!r}")
        return _build(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    raise ConfigError(f"{path}: unsupported config type {tp!r}")


def _build(cls: type, data: dict, prefix: str) -> Any:
    """Section ``cls`` from its mapping; its own checks (bounds, rules) run on construction."""
    hints = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        moved = getattr(cls, "MOVED_KEYS", {}).get(key)
        if moved is not None:
            raise ConfigError(f"config key {path!r} is now {prefix + '.' + moved!r}")
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {path!r}{hint} (allowed in "
                              f"{prefix or 'the top level'}: {', '.join(fields)})")
        kwargs[key] = _coerce(canonical(fields[key], value), hints[key], path)
    try:
        return cls(**kwargs)
    except SettingError as e:
        raise ConfigError(f"{prefix + '.' if prefix else ''}{e}") from None


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(overrides: list[str]) -> dict:
    """``["algorithm.loss=kl_cov", "trainer.lr=1e-6"]`` -> nested dict; values parsed as YAML."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        try:
            value = _floats_in_yaml(yaml.safe_load(raw)) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override")
        node[parts[-1]] = value
    return tree


def _floats_in_yaml(node: Any) -> Any:
    # PyYAML (YAML 1.1) reads "1e-6" as a string; the config means a number there.
    if isinstance(node, dict):
        return {k: _floats_in_yaml(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_floats_in_yaml(v) for v in node]
    if isinstance(node, str):
        try:
            return float(node) if any(c in node for c in "eE") and node[0] in "+-.0123456789" \
                else node
        except ValueError:
            return node
    return node


class DuplicateKeyError(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error: PyYAML lets the later
    value win silently, and a setting written twice is a mistake either way."""

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                continue  # refused by the constructor below, with its own message
            if key in first:
                raise DuplicateKeyError(f"key {key!r} appears twice in one mapping: line "
                                        f"{first[key]} and line {line}")
            first.setdefault(key, line)
        return super().construct_mapping(node, deep)


# The keys that name files or folders a run reads. A relative path in a config file is taken
# from the file's folder where it exists there, else from the working directory (the examples'
# paths are relative to the checkout's top). Outputs (logging.runs_dir,
# rollout.weight_sync.dir) and dotted overrides are relative to the working directory.
INPUT_PATH_KEYS = ("model.hf_path", "model.megatron_ckpt", "rollout.server.urls_file",
                   "data.train_files", "data.val_files", "eval.files", "trainer.resume",
                   "reward.function")


def _paths_beside(tree: dict, folder: Path) -> dict:
    """``tree`` (a config file's) with the relative paths of INPUT_PATH_KEYS that exist in
    ``folder`` made absolute there."""
    for key in INPUT_PATH_KEYS:
        *sections, name = key.split(".")
        node: Any = tree
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and name in node:
            value = node[name]
            node[name] = [_beside(v, folder) for v in value] if isinstance(value, list) \
                else _beside(value, folder)
    return tree


def _beside(value: Any, folder: Path) -> Any:
    """A relative path (also a ``path/to/file.py:function``) that exists in ``folder``, made
    absolute; anything else as it is (trainer.resume's "auto", a registered reward, an absolute
    path)."""
    if not isinstance(value, str) or not value or value.lower() in ("auto", "none"):
        return value
    path, colon, function = value, "", ""
    if ".py:" in value:  # reward.function's path/to/file.py:function
        path, colon, function = value.rpartition(":")
    if Path(path).is_absolute() or not (folder / path).exists():
        return value
    return os.path.abspath(folder / path) + colon + function


def load_config(path: Optional[Union[str, Path]] = None, overrides: Optional[list[str]] = None,
                data: Optional[dict] = None) -> Config:
    """Build the config from a YAML file (or a dict), then apply dotted overrides."""
    tree: dict = {}
    said: dict[str, str] = {}  # deprecated key -> the line about it (the value that is read)
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {str(p)!r} is a folder: give a YAML file in it "
                              "(e.g. examples/quickstart.yaml)")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.load(p.read_text(), Loader=_UniqueKeyLoader)
        except DuplicateKeyError as e:
            raise ConfigError(f"config file {str(p)!r}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text ({e.reason} at byte "
                              f"{e.start})") from None
        if loaded is None:
            raise ConfigError(f"config file {str(p)!r} is empty; start from "
                              "examples/quickstart.yaml")
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
        tree = _paths_beside(_renamed(_floats_in_yaml(loaded), said), p.parent)
    if data:
        tree = _merge(tree, _renamed(data, said))
    if overrides:
        tree = _merge(tree, _renamed(parse_overrides(overrides), said))
    cfg = _build(Config, tree, "")
    validate(cfg)
    cfg.deprecations = tuple(said.values())
    return cfg


def _renamed(tree: dict, said: dict[str, str]) -> dict:
    """A copy of ``tree`` with each key of ``Config.RENAMED_KEYS`` it holds moved to its new
    place, its value translated; a line about each into ``said``."""
    tree = copy.deepcopy(tree)
    for old, (new, values) in Config.RENAMED_KEYS.items():
        *parents, leaf = old.split(".")
        node: Any = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node.pop(leaf)
        moved = values.get(value, value) if isinstance(value, Hashable) else value
        *parents, leaf = new.split(".")
        target = tree
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"config key {old!r} moved to {new!r}, which is not a section "
                                  "here")
        if leaf in target:
            raise ConfigError(f"config keys {old!r} and {new!r} are both set; {old!r} is the "
                              f"old name of {new!r}: keep {new!r}")
        target[leaf] = moved
        renamed = f" ({value!r} is {moved!r} there)" if moved != value else ""
        said[old] = (f"config key {old!r} is deprecated: it is read as {new!r}{renamed}; "
                     "rename it")
    return tree
