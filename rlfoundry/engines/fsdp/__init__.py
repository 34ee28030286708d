"""The FSDP2 engine (``engine.py``), its forward passes (``forward.py``) and FSDP2 plumbing (``utils.py``)."""
