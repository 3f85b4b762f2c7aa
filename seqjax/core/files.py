"""What a run writes: atomic small files, and JSON that is always valid JSON.

Whole folders (an export, an import) are built in a hidden sibling and renamed
into place by :func:`staged_folder`, so a failure half-way leaves nothing behind.

Atomic writes: a reader, or a run killed mid-write, sees the old file or the
new one, never half of one. Used for every file a run rewrites in place (the
resolved config, the metrics log cut back on resume, the run summary).

JSON has no NaN or infinity (Python's ``json`` writes them as bare ``NaN``,
which other readers reject), so every JSON line or file seqjax writes goes
through :func:`json_text`, which writes a non-finite number as ``null``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from seqjax.core.errors import SeqjaxError, UsageError


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a temporary sibling, then rename it over ``path`` (atomic on POSIX)."""
    return _replace_atomic(path, lambda tmp: tmp.write_text(text))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """:func:`write_text_atomic` for bytes (a table that took long to compute, say), flushed to disk
    before the rename."""
    return _replace_atomic(path, lambda tmp: tmp.write_bytes(data), sync=True)


def _replace_atomic(path: str | os.PathLike, write, sync: bool = False) -> Path:
    """``write(tmp)`` to a temporary sibling (``sync``: flushed to disk), then renamed over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    if sync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
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
    """``obj`` as strict JSON (non-finite numbers as null); numpy scalars are written as plain
    numbers."""
    return json.dumps(finite_or_null(obj), indent=indent, allow_nan=False, default=_plain)


def _plain(obj: Any) -> Any:
    """numpy scalars and arrays (which json cannot write) as Python numbers and lists."""
    if hasattr(obj, "tolist"):
        return finite_or_null(obj.tolist())
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def check_new_folder(out: str | os.PathLike, *, overwrite: bool, flag: str = "--out") -> Path:
    """``out`` as a Path, or UsageError when it is a file, or a folder with files in it and
    ``overwrite`` is off."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {out}: is a file; expected a new or empty folder")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise UsageError(
            f"{flag} {out}: not empty (holds {shown}); choose a new or empty folder, or pass --overwrite "
            "to replace it whole")
    return out


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike, *, overwrite: bool, flag: str = "--out") -> Iterator[Path]:
    """Yield a hidden sibling of ``out`` to write into; on success it becomes ``out`` by one rename.

    An exception removes the sibling and leaves ``out`` as it was: a failed export is never
    half-written. ``out`` must be missing or empty (see :func:`check_new_folder`); with
    ``overwrite`` a non-empty ``out`` is replaced whole, and the old folder is removed only once the
    new one stands in its place.
    """
    out = check_new_folder(out, overwrite=overwrite, flag=flag)
    staging = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_staging(out)
        # left by a killed earlier attempt of this same process id
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    except OSError as err:
        raise UsageError(
            f"{flag} {out}: cannot write in {out.parent} ({err.strerror}); expected a folder you can "
            "write to") from None
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = out.with_name(f".{out.name}.{os.getpid()}.replaced")
        os.replace(out, old)
    # some writers (safetensors) create their files 0600: give the umask's mode
    for written in staging.rglob("*"):
        written.chmod(_umask_mode(0o777 if written.is_dir() else 0o666))
    os.replace(staging, out)  # over a missing or empty folder: atomic on POSIX
    if old is not None:
        shutil.rmtree(old)


def _umask_mode(mode: int) -> int:
    """``mode`` less the process's umask: what ``open``/``mkdir`` give a new file or folder."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def _remove_stale_staging(out: Path) -> None:
    """Remove ``.NAME.PID.partial`` / ``.replaced`` siblings of ``out`` left by a writer that was
    killed: their process is gone (as prepare takes over a stale lock). A live writer's folder is
    left alone."""
    for sibling in out.parent.glob(f".{glob.escape(out.name)}.*.*"):
        pid, _, kind = sibling.name[len(out.name) + 2:].partition(".")
        if kind in ("partial", "replaced"
                    ) and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def read_utf8(path: str | os.PathLike, error: type[SeqjaxError] = UsageError, what: str = "") -> str:
    """A text file a user hands seqjax (a chat template, a JSON config, a prompts file) as strict UTF-8; an
    unreadable file or a byte that is not UTF-8 is one ``error`` naming the file, the byte offset
    and what was expected. ``what`` names the file's role in the message
    (``data.chat_template``)."""
    path = Path(path)
    role = f"{what}: " if what else ""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise error(f"{role}{path}: cannot be read ({err.strerror or err}); expected a readable file") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise error(f"{role}{path}: byte {err.start} (0x{data[err.start]:02x}) is not UTF-8; expected a UTF-8 "
                    "text file (re-save it as UTF-8)") from None
