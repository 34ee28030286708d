"""``python -m rlfoundry <command> ...`` — the same as the ``rlfoundry`` console script."""

import sys

from rlfoundry.cli import main

if __name__ == "__main__":
    sys.exit(main())
