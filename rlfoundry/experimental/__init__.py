"""verl's experimental entry modules under rlfoundry's names (``verl.experimental.X`` ->
``rlfoundry.experimental.X``): thin modules that pick a config name and a pipeline and run the one
trainer (``trainer/main_ppo.py``)."""
