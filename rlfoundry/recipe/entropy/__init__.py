"""verl's entropy recipe (``recipe.entropy``, Clip-Cov / KL-Cov): its entry module, ``main_entropy``."""
