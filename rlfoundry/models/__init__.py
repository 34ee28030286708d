"""Model helpers: tiny locally-built Hugging Face models and tokenizers for machines without a hub."""

from rlfoundry.models import mimo as _mimo  # registers model_type "mimo" (no MiMo class in transformers)
from rlfoundry.models.tiny import build_tiny_model, build_tokenizer, save_tiny_model

__all__ = ["build_tokenizer", "build_tiny_model", "save_tiny_model"]
