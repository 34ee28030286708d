"""``python -m rlfoundry.plan ...``: the same as ``rlfoundry plan ...`` (rlfoundry/plan_cli.py).

Only a hand-over: the command line composes the trainer's config, so it lives above the trainer, while the
planner here stays below it (the trainer runs it as its start-up check). tests/test_import_direction.py holds
this module to importing its command line alone.
"""

import sys

from rlfoundry.plan_cli import main

if __name__ == "__main__":
    sys.exit(main())
