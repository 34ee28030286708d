"""rlfoundry: reinforcement-learning post-training for language models (verl-compatible)."""

__version__ = "0.1.0"
