"""``python -m inferencecache`` (see :mod:`inferencecache.cli`)."""

import sys

from inferencecache.cli import main

sys.exit(main())
