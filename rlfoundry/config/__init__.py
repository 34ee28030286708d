"""Packaged trainer configs (YAML) and their typed schema (``schema.py``)."""
