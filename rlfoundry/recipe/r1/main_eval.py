"""``python -m rlfoundry.recipe.r1.main_eval [key=value ...]``: verl's R1 recipe's offline scorer
(``recipe.r1.main_eval``, run by ``recipe/r1/run_r1_distill_qwen.sh`` after ``main_generation``).

verl's recipe module is ``verl.trainer.main_eval`` under the recipe's own ``config/evaluation.yaml`` (the
same keys, without ``ray_kwargs.timeline_json_file``) and scores the same way: per row the mean score of
its responses, per data source the mean of those (``test_score/<data_source>``). So this entry is
``rlfoundry.trainer.main_eval`` (its docstring has the keys; ``pass@<n>/<data_source>`` is printed too)
under this module's name. The recipe's script passes its ``recipe/r1/reward_score.py`` as
``custom_reward_function.path`` with ``.name=reward_func``: a verl checkout's file, whose ``import verl…``
lines run on rlfoundry (docs/verl_keys.md, "verl imports in your code").
``--cfg job`` prints the config a command line gives and exits.
"""

import sys
from collections.abc import Sequence

from rlfoundry.trainer.main_eval import load_eval_config, run_eval
from rlfoundry.trainer.main_generation import entry_main

MODULE = "rlfoundry.recipe.r1.main_eval"


def main(argv: Sequence[str] | None = None) -> int:
    return entry_main(argv, MODULE, __doc__, load_eval_config, run_eval)


if __name__ == "__main__":
    sys.exit(main())
