"""``python -m seqjax.generate``: the command itself is :mod:`seqjax.main.generate`."""

import sys

from seqjax.main.generate import main

if __name__ == "__main__":
    sys.exit(main())
