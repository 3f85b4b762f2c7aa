"""Lines: a corpus file's lines as bytes, streamed (plain, ``.gz`` and ``.zst``: several frames, cut
files caught), the one-line message for a compressed file that is cut or corrupt, and text cut into
lines as the store keeps them."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path

from seqjax.core.errors import CorpusError


def raw_lines(path: Path) -> Iterator[bytes]:
    """The file's lines as bytes, decompressed on the fly for ``.gz`` and ``.zst``."""
    if path.name.endswith(".gz"):
        # gzip reads 0 bytes as an empty stream; an interrupted copy leaves one
        if path.stat().st_size == 0:
            raise EOFError("0 bytes, not even a gzip header")
        with gzip.open(path, "rb") as stream:
            yield from stream
    elif path.name.endswith(".zst"):
        yield from zstd_lines(path)
    else:
        with open(path, "rb") as stream:
            yield from stream


def zstd_lines(path: Path) -> Iterator[bytes]:
    try:
        # optional: only .zst corpora need it (pip install -e '.[zst]')
        import zstandard
    except ImportError:
        raise CorpusError(
            f"{path}: reading .zst files needs the zstandard package; pip install -e '.[zst]'"
        ) from None
    decompressor, pending = zstandard.ZstdDecompressor().decompressobj(), b""
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            text = decompressor.decompress(block)
            # the next of several concatenated frames
            while decompressor.eof and decompressor.unused_data:
                rest, decompressor = decompressor.unused_data, zstandard.ZstdDecompressor(
                ).decompressobj()
                text += decompressor.decompress(rest)
            lines = (pending + text).split(b"\n")
            pending = lines.pop()
            yield from (line + b"\n" for line in lines)
    # a stream reader would just stop: a cut file must not pass for a short one
    if not decompressor.eof:
        raise zstandard.ZstdError("the file ends inside a frame")
    if pending:
        yield pending


def stream_errors() -> tuple[type[BaseException], ...]:
    """What a truncated or corrupt compressed stream raises while it is read."""
    errors: tuple[type[BaseException], ...] = (EOFError, zlib.error, gzip.BadGzipFile)
    try:
        # optional: present only with the zst extra; without it no .zst file gets this far
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


def damaged(path: Path, line: int, err: BaseException) -> CorpusError:
    """A compressed file that is cut or corrupt (or empty: 0 bytes), named with the line reading
    reached."""
    kind = "gzip" if path.name.endswith(".gz") else "zstd" if path.name.endswith(".zst") else "file"
    return CorpusError(
        f"{path}: line {line}: the {kind} stream is truncated or corrupt ({err}); expected a complete "
        f"{kind} file (re-copy or re-compress it)")


def split_lines(text: str) -> list[str]:
    """Lines with their ``\\n`` kept (only ``\\n`` ends a line, unlike str.splitlines); joining
    gives ``text``."""
    lines = text.split("\n")
    last = lines.pop()
    out = [line + "\n" for line in lines]
    if last:
        out.append(last)
    return out
