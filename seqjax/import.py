"""``python -m seqjax.import``: the command itself is :mod:`seqjax.main.import_hf` (``import`` is a
keyword, so no module of that name can be imported; the installed command is ``seqjax-import``)."""

import sys

from seqjax.main.import_hf import main

if __name__ == "__main__":
    sys.exit(main())
