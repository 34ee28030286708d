"""Tests of rlfoundry.config: the typed schema and ``to_typed``."""
