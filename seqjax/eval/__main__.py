"""``python -m seqjax.eval``: the command itself is :mod:`seqjax.main.eval`."""

import sys

from seqjax.main.eval import main

if __name__ == "__main__":
    sys.exit(main())
