"""``python -m trainer``: the same as the ``trainer`` console script."""
import sys

from .cli import main

sys.exit(main())
