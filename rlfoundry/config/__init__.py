"""The typed trainer config: its schema (``schema.py``, the one source of the defaults), the packaged
overlays (``*.yaml``) and ``to_typed``, how a component takes its config subtree (``typed.py``)."""

from rlfoundry.config.typed import ConfigError, to_typed

__all__ = ["ConfigError", "to_typed"]
