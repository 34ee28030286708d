"""``python -m rlfoundry.plan ...``: the same as ``rlfoundry plan ...`` (rlfoundry/plan_cli.py).

Only a hand-over, run and not imported: the command line composes the trainer's config, so it lives above
the trainer, while the planner here stays below it (the trainer runs it as its start-up check); runpy hands
the process to it without this package depending on it.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("rlfoundry.plan_cli", run_name="__main__", alter_sys=True)
