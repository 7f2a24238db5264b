"""`python -m tools.soak ...`: see tools/soak/__init__.py."""

import sys

from tools.soak.cli import main

sys.exit(main())
