"""verl's DAPO recipe (``recipe.dapo``): its entry module, ``main_dapo``."""
