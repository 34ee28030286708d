"""verl's ``verl.experimental.fully_async_policy``: run with ``python -m rlfoundry.experimental.fully_async_policy.fully_async_main``."""
