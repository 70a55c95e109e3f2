"""``python -m mirrorsd``: the ``mirrorsd`` command (mirrorsd/apps/cli.py)."""
import sys

from mirrorsd.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
