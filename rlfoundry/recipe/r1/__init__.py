"""verl's R1 recipe (``recipe.r1``): its evaluation entry module, ``main_eval``."""
