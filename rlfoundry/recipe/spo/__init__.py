"""verl's SPO recipe (``recipe.spo``, arXiv:2509.13232): its entry module, ``spo_main_ppo``."""
