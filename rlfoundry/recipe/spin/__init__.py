"""verl's SPIN recipe (``recipe.spin``, arXiv:2401.01335): its entry module, ``main_spin``."""
