"""Lets PyPI's torchvision wheel (built against CUDA torch) import under the CPU torch of the vLLM venv.

vLLM's Qwen2-VL (and transformers' Qwen2-VL processor, which vLLM builds) import torchvision; only its
pure-Python transforms run there. PyPI's torchvision 0.28 links its C++ ops against CUDA torch, so they
do not load here; torchvision then still registers fake kernels for ``torchvision::nms`` / ``qnms`` and
its import fails ("operator torchvision::nms does not exist"). Installed by scripts/setup_vllm_cpu.sh as
a site-packages module plus a ``.pth`` line that imports it: when ``torchvision.extension`` has run and
found no ops, the two schemas are defined (calling them raises: no kernel), so the import goes on.
"""

import importlib.abc
import importlib.util
import sys

_SCHEMAS = {"nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"}
_LIBS = []  # keeps the definitions alive


class _AfterExtension(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torchvision.extension":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if not module._has_ops():
                import torch

                lib = torch.library.Library("torchvision", "FRAGMENT")
                for op, schema in _SCHEMAS.items():
                    lib.define(op + schema)
                _LIBS.append(lib)

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _AfterExtension) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterExtension())
