"""``python -m normlab.cli``: the same as the ``normlab`` command."""

import sys

from normlab.cli import main

sys.exit(main())
