"""Checkpoints: one package, one import name (``from rlfoundry import checkpoint as ckpt``).

- ``layout.py``: the directory protocol. Step directories (``global_step_N/``), the component and
  step markers with their manifests (size + SHA-256 of every file), the latest pointer, the
  trainer's own state file (``data.pt``: step, data-loader position, KL coefficient), retention,
  clean-up of interrupted saves, and the integrity checks resuming relies on.
- ``state.py``: one worker role's state in its directory: model + optimiser shards (DCP, or an
  engine's own through ``save_role`` / ``load_role``), LR schedule, extra state (engine and rollout
  counters), every rank's RNG, the HF config; staged, hashed and published atomically. Loading
  never unpickles arbitrary objects.
- ``export.py``: Hugging Face directories: an engine's live export, and the offline export of a
  saved role through the one dispatch by engine (``engine_exporter``).
- ``collective.py``: how the ranks of a group write together (rank 0 writes, errors reach all).

The on-disk format is described in ``layout.py`` and ``state.py``; docs/errors.md lists what each
failure looks like and what survives it.
"""

from __future__ import annotations

from rlfoundry.checkpoint import export, layout, state
from rlfoundry.checkpoint.export import *  # noqa: F403 - the package's API is its modules' __all__
from rlfoundry.checkpoint.layout import *  # noqa: F403
from rlfoundry.checkpoint.state import *  # noqa: F403

__all__ = [*layout.__all__, *state.__all__, *export.__all__]
