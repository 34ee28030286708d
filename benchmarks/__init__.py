"""Benchmarks: rlfoundry side by side with TRL's GRPOTrainer and with a hand-written GRPO floor.

See ``benchmarks/README.md`` for the commands. Shared workload, measurement and reporting code
lives in ``benchmarks.common``; each framework runs in its own subprocess (one runner module per
framework) so that peak memory and start-up are measured per framework.
"""
