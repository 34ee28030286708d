"""The Megatron-core training engine (``strategy=megatron``): tensor, pipeline and data parallelism.

``bridge.py`` builds megatron-core models from HF checkpoints (mbridge) and exports them back;
``forward.py`` runs micro-batches through megatron-core's pipeline schedules and computes
log-probs on vocab-parallel logits; ``cpu_compat.py`` lets all of it run on CPU processes over gloo.
Needs the ``megatron`` extra (``bridge.MEGATRON_INSTALL``).
"""
