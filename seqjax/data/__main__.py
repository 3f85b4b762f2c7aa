"""``python -m seqjax.data``: the command itself is :mod:`seqjax.main.data`."""

import sys

from seqjax.main.data import main

if __name__ == "__main__":
    sys.exit(main())
