"""``python -m relay_consumer run|verify ...``: the command (see :mod:`relay_consumer.cli`)."""

import sys

from .cli import main

sys.exit(main())
