"""verl's FlowRL recipe (``recipe.flowrl``, arXiv:2509.15207): its entry module, ``main_flowrl``."""
