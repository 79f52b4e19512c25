"""``python -m h3_blackwell.cli``: the h3-blackwell command."""

import sys

from .main import main

sys.exit(main())
