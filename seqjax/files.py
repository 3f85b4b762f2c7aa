"""What a run writes: atomic small files, and JSON that is always valid JSON.

Atomic writes: a reader, or a run killed mid-write, sees the old file or the
new one, never half of one. Used for every file a run rewrites in place (the
resolved config, the metrics log cut back on resume, the run summary).

JSON has no NaN or infinity (Python's ``json`` writes them as bare ``NaN``,
which other readers reject), so every JSON line or file seqjax writes goes
through :func:`json_text`, which writes a non-finite number as ``null``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a temporary sibling, then rename it over ``path`` (atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def finite_or_null(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float, at any depth, replaced by None.

    For example ``{"loss": nan, "steps": [1, inf]}`` becomes ``{"loss": None, "steps": [1, None]}``.
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def json_text(obj: Any, indent: int | None = None) -> str:
    """``obj`` as strict JSON (non-finite numbers as null); numpy scalars are written as plain numbers."""
    return json.dumps(finite_or_null(obj), indent=indent, allow_nan=False, default=_plain)


def _plain(obj: Any) -> Any:
    """numpy scalars and arrays (which json cannot write) as Python numbers and lists."""
    if hasattr(obj, "tolist"):
        return finite_or_null(obj.tolist())
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")
