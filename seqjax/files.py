"""Atomic small-file writes: a reader, or a run killed mid-write, sees the old file or the new one, never half of one.

Used for every file a run rewrites in place (the resolved config, the
metrics log cut back on resume, the run summary).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a temporary sibling, then rename it over ``path`` (atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
