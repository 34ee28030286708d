"""Training engines: the model, optimiser, update loop, offload and checkpoints behind one interface.

``base.TrainingEngine`` is the contract roles program against; ``fsdp.FSDPEngine`` implements it
with torch FSDP2. Import the submodules (this package keeps its import cheap).
"""
