"""``python -m kvpool demo [...]`` (the same as the ``kvpool`` console script)."""

import sys

from kvpool.cli import main

if __name__ == "__main__":
    sys.exit(main())
