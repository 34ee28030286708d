"""verl's GVPO recipe (``recipe.gvpo``, arXiv:2504.19599): its entry module, ``gvpo_main_ppo``."""
