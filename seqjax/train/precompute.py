"""``train.reference=precompute``: a preference run's reference log-probabilities computed once, before the
first step, and stored with the run; the step then reads them from the batch instead of running a
reference.

The table of a split is ``run.dir/reference/<split>.npz``: ``logps [pairs, 2]`` (each pair's chosen
and rejected sequence: the sum of the reference's log-probabilities over its scored targets) and
``identity``: the store's (tokenizer, text, pair count) and the data keys that cut the sequences,
and the reference model's (``train.init_from`` and an xxh3 over its weights,
:func:`seqjax.weights.adapters.base_identity`). A table of another store or model is refused in one
line; nothing is recomputed silently.

Every pair is scored once, in store order, packed as training packs them (unshuffled). The work is
saved every ``SAVE_EVERY_S`` seconds to ``<split>.partial.npz`` (atomically), so a run killed while
precomputing resumes the table where it stopped; the table is renamed into place when whole.

The batch field ``reference_logps`` (:func:`seqjax.data.pairs.with_reference`) puts each sequence's
value on its last scored target (0 elsewhere): summed by pair as the objectives sum the policy's
log-probabilities, it gives the reference's sums back, whatever the packing or the micro-batches."""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from seqjax.config.tree import Config, ConfigError
from seqjax.core.errors import CheckpointMismatchError
from seqjax.core.files import write_bytes_atomic
from seqjax.core.progress import progress_bar
from seqjax.data import pairs
from seqjax.data.epochs import epoch_in_order
from seqjax.objectives.base import target_logprobs
from seqjax.store.reader import TokenStore

log = logging.getLogger(__name__)

SAVE_EVERY_S = 60.0
# the data keys that change which tokens a sequence holds, or how they are scored
DATA_KEYS = ("seq_len", "overlong", "chat_template", "loss_on", "prompt_field", "chosen_field", "rejected_field")


def identity(config: Config, store: TokenStore, model: dict[str, Any]) -> dict[str, Any]:
    """What a table was computed from (JSON)."""
    return {"tokenizer": store.manifest.get("tokenizer_hash"), "text": store.text_identity,
            "pairs": store.num_docs // 2, "data": {k: getattr(config.data, k, None) for k in DATA_KEYS},
            "model": model}


def table_path(run_dir: Path, split: str) -> Path:
    return Path(run_dir) / "reference" / f"{split}.npz"


def _save(path: Path, logps: np.ndarray, meta: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, logps=logps, meta=np.asarray(json.dumps(meta)))
    write_bytes_atomic(path, buffer.getvalue())


def _load(path: Path) -> tuple[np.ndarray, dict[str, Any]]:
    with np.load(path) as f:
        return f["logps"], json.loads(str(f["meta"]))


def _check(meta: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    changed = [key for key in now if meta.get("identity", {}).get(key) != now[key]]
    if changed:
        raise CheckpointMismatchError(
            f"{path}: reference log-probabilities of another {' and '.join(changed)} than this run's; expected "
            f"the same store and reference model (remove {path.parent} to compute them again)")


def precompute(config: Config, store: TokenStore, split: str, reference_logprobs: Callable[[dict], Any],
               model: dict[str, Any], max_batches: int | None = None) -> np.ndarray:
    """The table ``[pairs, 2]`` of ``store`` (``split``), read from the run when it is there and was computed
    from this store and ``model`` (its identity), else computed with ``reference_logprobs`` (a
    jitted batch
    -> per-target log-probabilities of the scored targets), going on from a partial table if one was saved.
    ``max_batches``: stop after that many new batches, the work saved (a test's stand-in for a kill)."""
    run_dir = Path(config.run.dir)
    path, partial = table_path(run_dir, split), table_path(run_dir, split + ".partial")
    now = identity(config, store, model)
    if path.exists():
        logps, meta = _load(path)
        _check(meta, now, path)
        return logps
    logps, done = np.zeros((store.num_docs // 2, 2), np.float64), 0
    if partial.exists():
        logps, meta = _load(partial)
        _check(meta, now, partial)
        done = int(meta["batches"])
    total, in_order = epoch_in_order(config, store, start=done)
    saved = time.monotonic()
    with progress_bar(total=total, initial=done, desc=f"reference log-probabilities ({split})",
                      unit="batch") as bar:
        for k, batch in enumerate(in_order, start=done + 1):
            if max_batches is not None and k - done > max_batches:
                _save(partial, logps, {"identity": now, "batches": k - 1})
                return logps
            pairs.add_to_table(logps, batch, np.asarray(jax.device_get(reference_logprobs(batch)), np.float64))
            bar.update()
            if time.monotonic() - saved > SAVE_EVERY_S:
                _save(partial, logps, {"identity": now, "batches": k})
                saved = time.monotonic()
    logps = logps.astype(np.float32)
    _save(path, logps, {"identity": now})
    partial.unlink(missing_ok=True)
    return logps


def reference_tables(config: Config, graphdef: nnx.GraphDef, states: tuple, model: dict[str, Any],
                     stores: dict[str, TokenStore]) -> dict[str, np.ndarray]:
    """Each split's table (:func:`precompute`) of the reference ``nnx.merge(graphdef, *states)``, whose
    identity is ``model``. One process only: every process would need the whole table."""
    if jax.process_count() > 1:
        raise ConfigError(f"train.reference: got precompute with {jax.process_count()} processes; expected one "
                          "process (or train.reference=auto)")

    @jax.jit
    def logprobs(states, batch):
        return target_logprobs(nnx.merge(graphdef, *states), batch, None, batch["weights"] > 0)

    log.info("the reference model's log-probabilities, once for every pair: %s", ", ".join(stores))
    out = {split: precompute(config, store, split, lambda batch: logprobs(states, batch), model)
           for split, store in stores.items()}
    log.info("reference log-probabilities in %s", table_path(Path(config.run.dir), "*").parent)
    return out
