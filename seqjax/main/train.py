"""``python -m seqjax.train --config FILE [key=value ...]``: train, or resume when ``run.dir`` holds
checkpoints.

Exit codes: 0 done (the last stdout line is the run's JSON summary); 2 bad
input, before any work (:func:`seqjax.main.cli.run`), a ``run.dir`` another run
holds, or a checkpoint that does not fit the config; 1 the run stopped: a
non-finite loss under ``train.nonfinite=stop``, or a checkpoint that could not
be written; 128 + N stopped by signal N after writing a checkpoint.
"""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

from seqjax.core.files import json_text
from seqjax.main import cli
from seqjax.train.checkpoint import CheckpointWriteError
from seqjax.train.loop import train
from seqjax.train.metrics import MetricsWriteError, NonFiniteLoss
from seqjax.train.rollouts import RolloutWriteError
from seqjax.train.signals import Interrupted

log = logging.getLogger("seqjax.train")  # the command's name, as its log lines show it


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("python -m seqjax.train",
                   "Train a language model; resumes when run.dir already holds checkpoints.")
    return cli.run(p, argv, run_training)


def run_training(args: argparse.Namespace) -> int:
    try:
        summary = train(cli.load(args))
    except (NonFiniteLoss, CheckpointWriteError, MetricsWriteError, RolloutWriteError) as err:
        log.error("%s", err)
        return 1
    except Interrupted as err:
        log.warning("%s", err)
        return 128 + err.signum
    print(json_text(summary))
    return 0
