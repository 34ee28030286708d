"""verl's recipe entry modules under rlfoundry's names (``recipe.X`` -> ``rlfoundry.recipe.X``): thin
modules that pick a recipe's config name and run the one trainer (``trainer/main_ppo.py``), as
``rlfoundry.experimental`` does for verl's async entry points."""
