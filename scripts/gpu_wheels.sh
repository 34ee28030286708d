#!/usr/bin/env bash
# scripts/gpu_wheels.sh [DIR]: download the wheels that scripts/gpu_check.sh installs on a GPU machine
# without network (default DIR: .whl, git-ignored). Run it where pip reaches the package index; the
# versions are the ones this checkout's environment runs with (pip show), for CPython 3.12 on x86-64.
#
# The GPU image already holds torch, transformers, accelerate, peft, tokenizers, safetensors, numpy,
# pyarrow, pandas, fsspec, huggingface-hub, xxhash, sympy, psutil, pytest and the like
# (/work/.library/device/KINDS.md); these are the project's other imports (rlfoundry without Ray, the
# GPU tier, the benchmark's TRL side, megatron-core and mbridge for the Megatron engine's bf16 test), and
# transformers at this checkout's version (the image's is older;
# the GPU run then tests the transformers that CI tests; it needs only the image's tokenizers and
# huggingface-hub). antlr4-python3-runtime 4.9.3 (hydra's pin) has no wheel on the
# index: pip builds one from its pure-Python source.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYTHON=${PYTHON:-python3}
mkdir -p "$DIR"
grep -qxF "/$DIR/" .git/info/exclude 2> /dev/null || { mkdir -p .git/info; echo "/$DIR/" >> .git/info/exclude; }

NAMES=(tensordict pyvers hydra-core omegaconf datasets dill multiprocess torchdata math-verify latex2sympy2_extended
       pydantic pydantic_core annotated-types typing-inspection pyseccomp trl transformers megatron-core mbridge)
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

version() { "$PYTHON" -c "from importlib.metadata import version; print(version('$1'))"; }

for name in "${NAMES[@]}"; do
    spec="$name==$(version "$name")"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$DIR" "$spec" || { echo "gpu_wheels: no wheel for $spec" >&2; exit 1; }
done
"$PYTHON" -m pip wheel -q --no-deps -w "$DIR" "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
# GPU-only packages this checkout's (CPU) environment lacks, at pinned versions, pure Python: liger-kernel
# (model.use_liger; Triton kernels, on the GPU image's torch + triton; tests/gpu/test_compile_liger.py)
for spec in liger-kernel==0.8.5; do
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$DIR" "$spec" || { echo "gpu_wheels: no wheel for $spec" >&2; exit 1; }
done
ls "$DIR"
