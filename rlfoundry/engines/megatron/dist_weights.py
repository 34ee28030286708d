"""Initial weights from a megatron-core distributed checkpoint (verl's ``megatron.use_dist_checkpointing``,
``dist_checkpointing_path``, ``dist_checkpointing_prefix``), and writing one from an HF directory
(``rlfoundry.scripts.converter_hf_to_mcore``).

The layout is verl's: the directory *is* the dist checkpoint (``metadata.json`` and the ``*.distcp``
shards at its top), holding the model's sharded state dict as megatron-core's ``GPTModel`` names it
(``embedding.word_embeddings.weight``, ``decoder.layers.<global layer>.self_attention.linear_qkv.weight``,
``output_layer.weight`` ...; the norms under TransformerEngine's fused names, which megatron-core's
local layers map themselves onto), keys optionally behind a prefix (NeMo 2's ``module.``). Tensors are
keyed by their place in the whole model, so a checkpoint written at one tensor/pipeline layout loads
at any other. A role directory's ``mcore/`` (this engine's training checkpoints) has the same model keys
plus optimiser ones, so it loads too.

A value model takes the backbone only: ``output_layer.*`` in the checkpoint (an LM head, or another
critic's head) is not read, and the value head starts as it does from a causal LM's HF directory (zero),
as verl leaves its head untouched there.

Before anything loads, the checkpoint's tensor list is compared with the model's: a tensor the model
needs that the checkpoint lacks, one of another shape, or a model tensor the checkpoint has and the
model does not (more layers) is a start-up error naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["CONVERTER", "dist_checkpoint_problem", "load_dist_weights", "model_sharded_state", "save_dist_weights"]

CONVERTER = "python -m rlfoundry.scripts.converter_hf_to_mcore --hf_model_path <model.path> --output_path <dir>"

# keys in a checkpoint that are not model weights: this engine's optimiser state (a role's mcore/)
_NOT_WEIGHTS = ("optimizer.",)


def dist_checkpoint_problem(path: Any) -> str | None:
    """Why ``path`` cannot be a dist checkpoint to load (None: it may be). Reads nothing but the
    directory listing and megatron-core's ``metadata.json`` marker, so start-up checks can call it."""
    if not path:
        return "is not set"
    root = Path(str(path))
    if not root.is_dir():
        return "is not a directory"
    if not (root / "metadata.json").is_file():
        inner = root / "mcore" / "metadata.json"
        hint = f" (a training checkpoint's role directory: its model is under {root / 'mcore'})" if inner.is_file() else ""
        return f"has no metadata.json, so it is not a megatron-core distributed checkpoint{hint}"
    return None


def model_sharded_state(chunks: list[nn.Module], prefix: str = "") -> dict[str, Any]:
    """The chunks' sharded state dicts, one dict (each chunk's keys are its own layers', globally numbered)."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict(prefix=prefix)
    return {f"model{i}": c.sharded_state_dict(prefix=prefix) for i, c in enumerate(chunks)}


def save_dist_weights(chunks: list[nn.Module], path: str) -> None:
    """Write the chunks' weights as a dist checkpoint at ``path`` (every rank takes part)."""
    from megatron.core import dist_checkpointing

    Path(path).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model_sharded_state(chunks), str(path))


def load_dist_weights(chunks: list[nn.Module], path: str, prefix: str = "", value_model: bool = False,
                      key: str = "megatron") -> None:
    """Load every chunk's weights from the dist checkpoint at ``path`` (any layout; see the module
    docstring). ``key``: the config subtree named in errors (``critic.megatron`` ...)."""
    from megatron.core import dist_checkpointing

    problem = dist_checkpoint_problem(path)
    if problem:
        raise ValueError(f"{key}.dist_checkpointing_path={path!r} {problem}; point it at a directory written by "
                         f"`{CONVERTER}` (or set {key}.use_dist_checkpointing=false to load model.path's HF weights)")
    states = [_wanted(c.sharded_state_dict(prefix=prefix), prefix, value_model) for c in chunks]
    _check_against(states, path, prefix, value_model, key)
    for chunk, state in zip(chunks, states):
        loaded = dist_checkpointing.load(state, str(path))
        # strict=False: a value model's head is not in ``state`` (it keeps its own weights)
        chunk.load_state_dict({k[len(prefix):]: v for k, v in loaded.items()}, strict=False)


def _wanted(state: dict[str, Any], prefix: str, value_model: bool) -> dict[str, Any]:
    """What to read into a chunk: all of it, or for a value model all but its head."""
    head = f"{prefix}output_layer."
    return {k: v for k, v in state.items() if not (value_model and k.startswith(head))}


def _tensors(state: Any) -> dict[str, Any]:
    """The ShardedTensors of a (nested) sharded state dict, by checkpoint key; a factory (the gated MLP's
    fused fc1) as the tensors it saves as, built aside (the state dict keeps the factory for loading)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    found = {}
    for value in nested_values(state):
        if isinstance(value, ShardedTensorFactory):
            found.update(_tensors(value.build()))
        elif isinstance(value, ShardedTensor):
            found[value.key] = value
    return found


def _check_against(states: list[dict[str, Any]], path: str, prefix: str, value_model: bool, key: str) -> None:
    """Refuse a checkpoint of another model: missing tensors, other shapes, extra model tensors
    (compared over every rank's chunks, so each rank raises the same error)."""
    from megatron.core import dist_checkpointing

    stored = {k: tuple(t.global_shape) for k, t in dist_checkpointing.load_tensors_metadata(str(path)).items()}
    mine = {k: tuple(t.global_shape) for state in states for k, t in _tensors(state).items()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        mine = {k: s for part in every for k, s in part.items()}
    missing = sorted(set(mine) - set(stored))
    shapes = sorted(f"{k} {list(stored[k])} (the model's {list(s)})" for k, s in mine.items()
                    if k in stored and stored[k] != s)
    head = f"{prefix}output_layer."
    extra = sorted(k for k in stored if k not in mine and k.startswith(prefix) and not k.startswith(_NOT_WEIGHTS)
                   and not (value_model and k.startswith(head)))
    found = [f"{what}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
             for what, keys in (("missing", missing), ("other shapes", shapes), ("not in the model", extra)) if keys]
    if found:
        hint = f" (is {key}.dist_checkpointing_prefix={prefix!r} right?)" if missing and not set(mine) & set(stored) else ""
        raise ValueError(f"{key}.dist_checkpointing_path={path!r} holds another model than model.path's{hint}: "
                         f"{'; '.join(found)}. Convert model.path's checkpoint with `{CONVERTER}`, or point "
                         "model.path at the HF directory the checkpoint was made from.")


def weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (or are in one only): the converter's ``--test``."""
    return sorted(n for n in set(a) | set(b) if n not in a or n not in b or not torch.equal(a[n], b[n]))
