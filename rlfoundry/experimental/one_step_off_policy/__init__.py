"""verl's ``verl.experimental.one_step_off_policy``: run with ``python -m rlfoundry.experimental.one_step_off_policy.main_ppo``."""
