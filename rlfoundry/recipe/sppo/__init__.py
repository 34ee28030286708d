"""verl's SPPO recipe (``recipe.sppo``, Self-Play Preference Optimization): its entry module, ``main_sppo``."""
