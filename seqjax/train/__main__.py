"""``python -m seqjax.train``: the command itself is :mod:`seqjax.main.train`."""

import sys

from seqjax.main.train import main

if __name__ == "__main__":
    sys.exit(main())
