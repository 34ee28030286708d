#!/usr/bin/env bash
# Build the virtual environment that runs the SGLang rollout on a CPU-only machine.
#
#   bash scripts/setup_sglang_cpu.sh            # creates ./.venv-sglang (idempotent)
#   SGLANG_VENV=/path/to/venv bash scripts/setup_sglang_cpu.sh
#   bash scripts/test_sglang.sh                  # the SGLang engine's tests (engine vs HF, weight sync, ...)
#
# Run SGLang from it with SGLANG_USE_CPU_ENGINE=1 set before `import sglang`, and
#   sglang.Engine(..., device="cpu", attention_backend="torch_native", disable_overlap_schedule=True,
#                 sleep_on_idle=True)
# (sleep_on_idle: otherwise the idle scheduler process busy-polls a whole core).
#
# Why a separate environment, built this way: the sglang 0.5.23 wheel requires CUDA-only packages
# (sglang-kernel, flashinfer, cuda-python, nvidia-*, flash-attn-4, ...), torch==2.14.1 and
# transformers==5.19.0, none of which its CPU path uses. So sglang goes in with --no-deps, beside the
# CPU torch wheel and only the modules its CPU path imports (SGLANG_CPU_DEPS below, found by importing
# sglang, sglang.srt.entrypoints.engine and starting an Engine), plus two import-only stand-ins from
# scripts/sglang_cpu_standins/: torchvision (imported by vision-model configs) and sgl_kernel's CPU
# symbols (called only on CPUs with Intel AMX). On a GPU machine install `sglang` normally instead.
# Takes ~3-5 minutes on a fresh machine (triton is the big download); re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-.venv-sglang}
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
SGLANG_VERSION=0.5.23
# The main environment's versions (what `pip install -e '.[test]'` brings); SGLang 0.5.23 pins
# transformers 5.19.0 / tokenizers 0.23.2 but its CPU text path runs on these.
TRANSFORMERS_VERSION=5.24.0
TOKENIZERS_VERSION=0.23.3

# What SGLang 0.5.23's CPU path imports beyond rlfoundry's own dependencies (numpy, requests, psutil,
# pillow, pydantic, safetensors, ...), each with the first module that needs it. Exact pins are
# SGLang's own where it pins; the rest are the versions this was tested with.
SGLANG_CPU_DEPS=(
  "orjson==3.13.0"                  # sglang/srt/utils/common.py
  "pybase64==1.5.1"                 # sglang/srt/utils/common.py (tensor payloads)
  "triton==3.9.0"                   # sglang/srt/utils/common.py and every @triton.jit kernel module; imported, never run on CPU
  "starlette==1.10.0"               # sglang/srt/utils/common.py
  "fastapi==0.165.0"                # sglang/srt/entrypoints/engine_info_bootstrap_server.py, tokenizer manager
  "uvicorn==0.54.0"                 # sglang/srt/entrypoints/engine_info_bootstrap_server.py
  "uvloop==0.23.0"                  # sglang/srt/entrypoints/engine.py (sets the asyncio loop policy)
  "msgspec==0.22.0"                 # sglang/srt/platforms/interface.py (server args, IPC structs)
  "pyzmq==27.3.0"                   # sglang/srt/utils/network.py (IPC between engine processes)
  "ipython==9.18.1"                 # sglang/utils.py (import sglang)
  "aiohttp==3.14.5"                 # sglang/lang/backend/runtime_endpoint.py (import sglang)
  "apache-tvm-ffi==0.1.11"          # sglang/kernels/ops/communication/all_reduce.py (pinned by sglang)
  "sentencepiece==0.2.1"            # sglang/srt/configs/internvl.py (pinned by sglang)
  "compressed-tensors==0.18.0"      # sglang/srt/layers/quantization/compressed_tensors (pinned by sglang)
  "gguf==0.19.0"                    # sglang/srt/layers/quantization/gguf.py
  "openai==2.8.0"                   # sglang/srt/entrypoints/openai/protocol.py (pinned by sglang)
  "partial-json-parser==0.2.1.1.post7"  # sglang/srt/function_call/base_format_detector.py
  "setproctitle==1.3.8"             # sglang/srt/managers/data_parallel_controller.py
  "xgrammar==0.2.7"                 # sglang/srt/function_call/inkling_detector.py, grammar backend (pinned by sglang)
)

if [ ! -x "$VENV/bin/python" ]; then
  echo "[rlfoundry] creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# sglang is installed --no-deps, so pip lists its unmet (CUDA) requirements after every install: drop those.
pip_q() {
  "$VPY" -m pip install --quiet "$@" 2> >(grep -vE "^sglang [0-9.]+ requires |^ERROR: pip's dependency resolver does not" >&2)
}
installed() { "$VPY" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }

# torch first, from the local CPU wheel when present, so nothing later pulls another build.
if ! "$VPY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "[rlfoundry] installing torch==$TORCH_VERSION (CPU)"
  pip_q "torch==$TORCH_VERSION"
fi
if ! "$VPY" -W ignore -c "import torch, sys; sys.exit(torch.version.cuda is not None)"; then
  echo "[rlfoundry] $VENV has a CUDA build of torch; this environment needs the CPU wheel" >&2
  exit 1
fi

# Nothing below may move these.
constraints=$(mktemp)
standins=$(mktemp -d)
trap 'rm -rf "$constraints" "$standins"' EXIT
printf '%s\n' "torch==$TORCH_VERSION" "transformers==$TRANSFORMERS_VERSION" "tokenizers==$TOKENIZERS_VERSION" > "$constraints"

echo "[rlfoundry] installing SGLang's CPU-path dependencies"
pip_q -c "$constraints" "transformers==$TRANSFORMERS_VERSION" "tokenizers==$TOKENIZERS_VERSION" "${SGLANG_CPU_DEPS[@]}"

if ! installed sglang "$SGLANG_VERSION"; then
  echo "[rlfoundry] installing sglang==$SGLANG_VERSION (--no-deps)"
  pip_q --no-deps "sglang==$SGLANG_VERSION"
fi

# rlfoundry itself, under the same constraints.
pip_q -c "$constraints" -e ".[test]"

# The stand-ins last, so nothing installed above can overwrite them; a real torchvision or
# sgl-kernel (CUDA builds on PyPI) would shadow them and break the import against the CPU torch.
"$VPY" -m pip uninstall --yes --quiet torchvision sgl-kernel sglang-kernel 2>/dev/null || true
cp -r scripts/sglang_cpu_standins/torchvision scripts/sglang_cpu_standins/sgl_kernel "$standins/"
pip_q --no-deps --no-build-isolation --force-reinstall "$standins/torchvision" "$standins/sgl_kernel"

SGLANG_USE_CPU_ENGINE=1 "$VPY" -W ignore - <<'PY'
import importlib.metadata as m
import sgl_kernel, torchvision
assert sgl_kernel.STANDIN and torchvision.STANDIN, "a real sgl_kernel/torchvision shadows the stand-ins"
import torch, transformers, triton, sglang
import sglang.srt.entrypoints.engine  # the whole CPU import path
print(f"[rlfoundry] SGLang env ready: sglang {sglang.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, tokenizers {m.version('tokenizers')}, "
      f"triton {triton.__version__}, xgrammar {m.version('xgrammar')}; stand-ins: torchvision, sgl_kernel")
PY
