"""``python -m rlfoundry.model_merger merge|test ...``: verl's ``python -m verl.model_merger`` (see the package)."""

import sys

from rlfoundry.model_merger.merge import main

if __name__ == "__main__":
    sys.exit(main())
