"""``python -m seqjax.export``: the command itself is :mod:`seqjax.main.export`."""

import sys

from seqjax.main.export import main

if __name__ == "__main__":
    sys.exit(main())
