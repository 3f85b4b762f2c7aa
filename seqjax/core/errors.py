"""The errors that mean "the input is wrong": one base, so every CLI turns them into one line and
exit code 2.

``SeqjaxError`` is the base of the config, corpus, tokenizer, store and data
errors, of the run's own (a run.dir another run holds, a checkpoint that does
not fit the config it is loaded under), and of two the CLIs add: an
unreadable checkpoint and an impossible command-line request.

Each is a ``ValueError`` (bad input is a bad value) and a :class:`SeqjaxError`,
the one type :func:`seqjax.main.cli.run` catches. A message names the key, file or
document, the value, and what was allowed, so no traceback is needed to act
on it. Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class SeqjaxError(ValueError):
    """Bad input a user can fix; the message says what and how."""


class ConfigError(SeqjaxError):
    """A config key, value or file is wrong. The message says which and what is allowed."""


class CorpusError(SeqjaxError):
    """A corpus file is missing or unreadable. The message names the file and what to do."""


class TokenizerError(SeqjaxError):
    """A tokenizer cannot be trained or loaded as asked. The message says which setting and why."""


class StoreError(SeqjaxError):
    """A store is missing, incomplete, or does not match the tokenizer asked for."""


class DataError(SeqjaxError):
    """The data cannot produce what the config asks for (too small, overlong document under
    ``error``, ...)."""


class CheckpointError(SeqjaxError):
    """A run or checkpoint folder holds no readable checkpoint (seqjax.train.checkpoint)."""


class CheckpointMismatchError(SeqjaxError):
    """A complete checkpoint does not fit the config it is loaded under: the message lists the
    differing keys.

    Nothing is moved or deleted: the checkpoint is fine, the request is not.
    """


class RunDirInUseError(SeqjaxError):
    """Another training run holds the lock on ``run.dir``; the message names its host, PID and start
    time."""


class UsageError(SeqjaxError):
    """A command-line request is impossible: a flag's value, a prompt, a length (seqjax.main.cli and
    the CLIs)."""
