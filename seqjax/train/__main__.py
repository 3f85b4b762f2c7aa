"""``python -m seqjax.train --config configs/X.yaml [key=value ...]``"""

import sys

from seqjax.train.loop import main

sys.exit(main())
