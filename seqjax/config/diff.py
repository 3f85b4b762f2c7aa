"""What changed between a checkpoint's config and the config a run resumes under, key by key, with
its kind.

Each key's ``resume`` metadata in :mod:`seqjax.config.tree` says what changing it does
to a resumed run (exact resume, other batches, another model);
:func:`resume_changes` lists the changed keys with that kind, and
:mod:`seqjax.weights.saved` decides from them.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from seqjax.config.tree import Config

# Not compared: the switch that allows the others to change.
_NOT_COMPARED = ("train.allow_config_change",)


@dataclass(frozen=True)
class ConfigChange:
    """One leaf key whose value differs between a checkpoint's config and the current one."""

    key: str
    old: Any
    new: Any
    kind: str  # one of RESUME_KINDS

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def _field_metadata(cls: type = Config,
                    prefix: str = "") -> dict[str, tuple[Any, typing.Mapping[str, Any]]]:
    """Every dotted leaf key -> (its default, its field metadata)."""
    out = {}
    defaults = cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_field_metadata(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = (getattr(defaults, f.name), f.metadata)
    return out


def _flatten(tree: typing.Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys to values; a key whose value is itself a mapping (data.chat_template_kwargs) stays
    one key."""
    out = {}
    mappings = {key for key, (default, _) in _field_metadata().items() if isinstance(default, dict)}
    for name, value in tree.items():
        if isinstance(value, typing.Mapping) and prefix + name not in mappings:
            out.update(_flatten(value, f"{prefix}{name}."))
        else:
            out[prefix + name] = value
    return out


def resume_changes(saved: typing.Mapping[str, Any], current: Config) -> list[ConfigChange]:
    """The keys whose values differ between ``saved`` (a checkpoint's config, as a dict) and
    ``current``.

    Each change carries its kind (field metadata ``resume``, default ``exact``). A key the saved
    config lacks (added to seqjax since) is compared with its default; a key it has that no longer
    exists is ignored. For example, a run checkpointed with ``data.batch_size=16`` and resumed with
    ``data.batch_size=8 train.steps=900`` gives ``[ConfigChange("data.batch_size", 16, 8, "data"),
    ConfigChange("train.steps", 1000, 900, "exact")]``.
    """
    old, new = _flatten(saved), _flatten(current.to_dict())
    if old.get("train.reference") == "precompute":  # read as TrainConfig.check reads its older spelling
        old["train.reference"], old["train.precompute_reference"] = "auto", True
    changes = []
    for key, (default, meta) in _field_metadata().items():
        if key in _NOT_COMPARED:
            continue
        before, after = old.get(key, default), new[key]
        if isinstance(before, list) and isinstance(after, list):
            before = list(before)
        if before != after:
            changes.append(ConfigChange(key, before, after, meta.get("resume", "exact")))
    return changes
