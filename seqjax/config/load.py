"""Reading a config: a YAML file plus dotted ``key=value`` overrides, typed, range-checked and
validated.

The schema (every key, its type, range and help line) is :mod:`seqjax.config.tree`;
this module turns text into that tree and says, in one line, which key, value
and source (the file, or the command line) is wrong, with a "did you mean" on
typos. :func:`describe_keys` prints the schema for ``--help-config``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import logging
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from seqjax.config.tree import Config
from seqjax.core.errors import ConfigError


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A config dataclass's field types, resolved once (typing evaluates its string annotations anew
    on every call, the most of a config load's time)."""
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if _is_optional(tp):
        return f"{_type_name(_strip_optional(tp))} or null"
    origin = typing.get_origin(tp)
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union,
                                     types.UnionType) and type(None) in typing.get_args(tp)


def _strip_optional(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0]


def _coerce(key: str, value: Any, tp: Any, meta: typing.Mapping[str, Any]) -> Any:
    """Check ``value`` against the field type and metadata; return it in the field's type."""
    if value is None:
        if _is_optional(tp):
            return None
        raise ConfigError(f"{key}: got null, expected {_type_name(tp)}")
    base = _strip_optional(tp) if _is_optional(tp) else tp
    origin = typing.get_origin(base)
    if origin is list and meta.get("one_or_list") and not isinstance(value, (list, tuple)):
        value = [value]  # train.objective=dpo: a list of one
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: got {value!r}, expected {_type_name(base)}")
        (item_tp,) = typing.get_args(base)
        if dataclasses.is_dataclass(
                item_tp):  # data.sources: a list of mappings, each checked like a section
            return [_build_item(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
        return [_coerce(f"{key}[{i}]", v, item_tp, {}) for i, v in enumerate(value)]
    if origin is dict:  # data.chat_template_kwargs: a mapping passed on as it is
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: got {value!r}, expected a mapping of names to values")
        return dict(value)
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: got {value!r}, expected true or false")
    elif base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: got {value!r}, expected an integer")
    elif base is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: got {value!r}, expected a number")
        value = float(value)
        if not math.isfinite(
                value):  # YAML reads nan, .inf and 1e999 as floats; no key means anything by them
            raise ConfigError(f"{key}: got {value!r}, expected a finite number")
    elif base is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: got {value!r}, expected a string")
    if "choices" in meta and value not in meta["choices"]:
        close = difflib.get_close_matches(str(value), list(map(str, meta["choices"])), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(
            f"{key}: got {value!r}, expected one of {', '.join(map(str, meta['choices']))}{hint}")
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"{key}: got {value!r}, expected at least {meta['min']}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{key}: got {value!r}, expected at most {meta['max']}")
    return value


def _item_dataclass(tp: Any) -> type | None:
    """The item type of a ``list[SomeDataclass]`` field (``data.sources``), else None."""
    if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return typing.get_args(tp)[0]
    return None


def _build_item(key: str, value: Any, cls: type) -> Any:
    if not isinstance(value, dict):
        names = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ConfigError(f"{key}: got {value!r}, expected a mapping with keys among {names}")
    return _build(cls, value, key + ".")


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the tree, for help and typo suggestions (a list item's keys as
    ``data.sources[].x``)."""
    keys = []
    for name, tp in _hints(cls).items():
        if dataclasses.is_dataclass(tp):
            keys += [prefix + name] + all_keys(tp, f"{prefix}{name}.")
        elif _item_dataclass(tp) is not None:
            keys += [prefix + name] + all_keys(_item_dataclass(tp), f"{prefix}{name}[].")
        else:
            keys.append(prefix + name)
    return keys


def _unknown_key(key: str) -> ConfigError:
    close = difflib.get_close_matches(re.sub(r"\[\d+\]", "[]", key), all_keys(), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else "; run with --help-config to list the keys"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in values:
        if name not in fields:
            raise _unknown_key(prefix + name)
    kwargs = {}
    for name, f in fields.items():
        tp = hints[name]
        key = prefix + name
        if dataclasses.is_dataclass(tp):
            sub = values.get(name) or {}
            if not isinstance(sub, dict):
                raise ConfigError(f"{key}: got {sub!r}, expected a mapping of {tp.__name__} keys")
            kwargs[name] = _build(tp, sub, key + ".")
        elif name in values:
            kwargs[name] = _coerce(key, values[name], tp, f.metadata)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise _unknown_key(key)
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``data.seq_len=512`` -> ("data.seq_len", 512); the value is read as YAML (so 1e-3, true,
    null, [1,2] work)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, for example data.seq_len=512")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: the key before '=' is empty")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


class _DuplicateKey(ValueError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``, except that a key given twice in one mapping is an error.

    YAML keeps the last of two equal keys, so a second ``train:`` block appended to a file would
    silently drop the first one's learning rate and warmup.
    """

    def construct_mapping(self, node, deep=False):
        self.flatten_mapping(node)
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(
                    f"key {key!r} is given twice (lines {seen[key]} and {line}); expected each key "
                    "once in its section (YAML would keep only the last)")
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_config(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = (),
                base: dict[str, Any] | None = None, *, record: bool = False) -> Config:
    """Read a YAML config (or start from ``base``, a tree of section mappings, or the defaults),
    apply dotted overrides, validate everything. ``record``: this is the command's own config
    (its file and overrides are what :func:`announce` names; a config read on the way, a run's
    that ``train.init_from`` names, is not)."""
    global _GIVEN
    if record:
        _GIVEN = (None if path is None else str(path), [str(o) for o in overrides])
    tree: dict[str, Any] = copy.deepcopy(base) if base else {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(
                f"config file {str(path)!r} is a folder (expected a YAML file such as "
                "configs/wikitext2_cpu.yaml)")
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} not found (expected a YAML file such as "
                "configs/wikitext2_cpu.yaml)"
            )
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8-sig")  # (a UTF-8 byte-order mark is fine)
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"config file {str(path)!r}: byte {err.start} (0x{raw[err.start]:02x}) is not "
                "UTF-8; expected a UTF-8 YAML file (re-save it as UTF-8)") from None
        try:
            loaded = yaml.load(text, Loader=_UniqueKeyLoader)
        except _DuplicateKey as err:
            raise ConfigError(f"config file {str(path)!r}: {err}") from None
        except yaml.YAMLError as err:
            one_line = " ".join(str(err).split())
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {one_line}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {str(path)!r}: expected a mapping of sections, got "
                f"{type(loaded).__name__}"
            )
        tree = loaded or {}
    from_file = copy.deepcopy(tree)
    for item in overrides:
        key, value = parse_override(item)
        try:
            _set_dotted(tree, key, value)
        except ConfigError as err:
            raise ConfigError(f"{err} (from the command line: {item})") from None
    _format_defaults(tree, {parse_override(item)[0] for item in overrides})
    try:
        config = _build(Config, tree, "")
    except ConfigError as err:
        raise ConfigError(f"{err}{_source_of_error(path, from_file, overrides)}") from None
    config.check()
    # the keys the command line set (a model folder's own config yields to the file's, not to these:
    # seqjax.weights.init_from.adopt_model)
    config.explicit = frozenset(parse_override(item)[0] for item in overrides)
    return config


# defaults that follow data.format, where the field's own default (lm) is not what such a run trains
# with: an RL run's objective is TRL's default loss type. A value of a file that can never serve the
# format (a saved config.yaml's objective [lm], under data.format=prompt on the command line) yields
# to it too; the same value given on the command line stays, and is refused as the data's batches
# are.
FORMAT_DEFAULTS = {"prompt": {("train", "objective"): (["dapo"], (["lm"], "lm"))}}


def _format_defaults(tree: dict[str, Any], given: set[str]) -> None:
    data = tree.get("data")
    fmt = data.get("format") if isinstance(data, dict) else None
    for (section, key), (value, never) in FORMAT_DEFAULTS.get(fmt, {}).items():
        part = tree.setdefault(section, {})
        if not isinstance(part, dict) or f"{section}.{key}" in given:
            continue
        if key not in part or part[key] in never:
            if key in part:
                logging.getLogger("seqjax.config").info(
                    "%s.%s: %s (the file's %s cannot train data.format=%s)", section, key, value, part[key], fmt)
            part[key] = value


def _source_of_error(path: Path | None, from_file: dict[str, Any],
                     overrides: typing.Sequence[str]) -> str:
    """Where a bad value came from: " (in FILE)" or " (from the command line: key=value)".

    The file alone is built first; if it is fine, the overrides are applied
    one at a time and the first that breaks the build is named. (Only on the
    error path: a config that loads is built once.)
    """
    tree = copy.deepcopy(from_file)
    try:
        _build(Config, tree, "")
    except ConfigError:
        return f" (in {path})" if path is not None else ""
    for item in overrides:
        _set_dotted(tree, *parse_override(item))
        try:
            _build(Config, tree, "")
        except ConfigError:
            return f" (from the command line: {item})"
    return ""


def announce(config: Config, out_dir: str | os.PathLike, name: str = "config.yaml",
             final: str | os.PathLike | None = None, given: tuple[str | None, list[str]] | None = None) -> Path:
    """Save the resolved config beside the outputs it produced, and say where in one line
    (stderr): the file holds every key, so the log does not repeat them (the command line's
    overrides are logged when it is read, :func:`seqjax.main.cli.load`). ``final``: the folder
    the file will be in once ``out_dir`` (a staging folder) is renamed into place, which the line
    names; ``given``: (the file, the overrides) it came from, when not the command's own load's."""
    path = config.save(Path(out_dir) / name)
    file, overrides = given or _GIVEN
    shown = path if final is None else Path(final) / name
    logging.getLogger("seqjax.config").info("resolved config: %s (from %s%s)", shown, file or "the "
                                                                                              "defaults",
                                            f"; overrides: {' '.join(overrides)}" if overrides else "")
    return path


# What the last load_config call read (a command reads one config): the file and the overrides, for
# announce.
_GIVEN: tuple[str | None, list[str]] = (None, [])


def describe_keys() -> str:
    """A table of every key, its type, default and help line (``--help-config``)."""
    lines = []
    defaults = Config()

    def walk(cls, obj, prefix):
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                if prefix:  # a section inside a section (model.rope_scaling) gets a line of its own
                    lines.append(
                        f"{prefix + f.name:32s} {'section':18s} {f.metadata.get('help', '')}")
                walk(tp, getattr(obj, f.name), prefix + f.name + ".")
                continue
            if _item_dataclass(tp) is not None:
                lines.append(
                    f"{prefix + f.name:32s} {'list of mappings':18s} default=[]  "
                    f"{f.metadata.get('help', '')}"
                )
                walk(_item_dataclass(tp), _item_dataclass(tp)(), f"{prefix}{f.name}[].")
                continue
            allowed = f" one of {list(f.metadata['choices'])}" if "choices" in f.metadata else ""
            lines.append(
                f"{prefix + f.name:32s} {_type_name(tp):18s} "
                f"default={getattr(obj, f.name)!r}{allowed}  {f.metadata.get('help', '')}")

    walk(Config, defaults, "")
    return "\n".join(lines)
