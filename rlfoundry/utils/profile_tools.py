"""The ``global_profiler.tool`` values the torch trace (utils/profiler.py) serves: torch-free, so the
config schema can name them without importing the profiler (or torch)."""

TORCH_PROFILER_TOOLS = ("torch", "torch_memory")
