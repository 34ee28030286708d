"""Tools a policy calls in multi-turn rollouts: verl's tool interface (``base.BaseTool``,
``schemas``), tool configs in verl's YAML layout (``registry``), the hermes call parser (``parser``),
the concurrent, contained call runner (``runner``), and built-in tools: ``calculator``,
``code_interpreter`` (the kernel-namespaced sandbox of ``rlfoundry.sandbox``) and verl's ``gsm8k`` answer tool.

Import from the submodules; this package keeps its import cheap.
"""
