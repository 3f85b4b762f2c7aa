"""``python -m seqjax.import HF_DIR --out DIR``: runs :mod:`seqjax.import_hf` (``import`` is a keyword, so the
code lives there and the installed command is ``seqjax-import``)."""

import sys

from seqjax.import_hf import main

if __name__ == "__main__":
    sys.exit(main())
