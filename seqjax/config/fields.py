"""How a config key is declared: :func:`setting` (a dataclass field with its help line and
validation metadata), and what changing a key does to a resumed run.

Every key may carry metadata:

- ``choices``: the allowed values;
- ``min`` / ``max``: an inclusive numeric range;
- ``help``: one line for the README and for error messages;
- ``resume``: what changing the key does to a run resumed from a checkpoint
  (:data:`RESUME_KINDS`); keys without it keep exact resume;
- ``one_or_list``: a list key that also takes one value, as a list of one.
"""

from __future__ import annotations

from dataclasses import field

DATA_DIR_ENV = "SEQJAX_DATA_DIR"


def setting(default, help: str, **meta):
    """A dataclass field with its help line and validation metadata."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


# What a key changed between a checkpoint and its resume does (field metadata ``resume``; see
# resume_changes): "exact": the steps after the checkpoint are still the ones the old config would
# have taken (bookkeeping, evaluation, mesh, backends), or the change only takes effect from the
# next update on (optimizer settings); "data": the batches change (order, rows, tokens): refused
# unless train.allow_config_change, and then the data restarts at the next epoch boundary; "model":
# the function the parameters compute changes (shapes are checked against the checkpoint itself):
# refused unless train.allow_config_change.
RESUME_KINDS = ("exact", "data", "model")
DATA, MODEL = "data", "model"


def hashable(value):
    """A config value in a form that hashes: lists (model.remat_names,
    model.vision.deepstack_visual_indexes) as tuples, at any depth."""
    return tuple(map(hashable, value)) if isinstance(value, (list, tuple)) else value
