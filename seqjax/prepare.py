"""``python -m seqjax.prepare``: the command itself is :mod:`seqjax.main.prepare`."""

import sys

from seqjax.main.prepare import main

if __name__ == "__main__":
    sys.exit(main())
