#!/usr/bin/env bash
# Install rlfoundry (editable) into the active Python, with optional extras: `bash scripts/install.sh test`.
# On a machine with no torch, the CPU wheel goes in first so that no dependency pulls the
# multi-GB CUDA build; a torch that is already installed is left exactly as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[rlfoundry] no torch found: installing the CPU wheel torch==2.13.0"
  "$PY" -m pip install --quiet "torch==2.13.0"
else
  echo "[rlfoundry] using installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi
# The sandbox for generated code (code rewards, the code tool) is bubblewrap's namespaces: install it
# where this script may (root with apt-get); elsewhere say how. Without it such runs refuse to start
# unless sandbox.allow_unisolated=true (docs/sandbox.md).
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[rlfoundry] installing bubblewrap (the code sandbox's namespaces)"
    apt-get install -y -qq bubblewrap >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } \
      || echo "[rlfoundry] note: could not install bubblewrap; see docs/sandbox.md" >&2
  else
    echo "[rlfoundry] note: bubblewrap (bwrap) is not installed; code rewards and the code tool need it (docs/sandbox.md)" >&2
  fi
fi
extras=""
if [ "$#" -gt 0 ]; then extras="[$(IFS=,; echo "$*")]"; fi
"$PY" -m pip install --quiet -e ".${extras}"
# pyenv only sees new console scripts after a rehash (plain `pip` triggers it, `python -m pip` does not)
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
if ! command -v rlfoundry >/dev/null 2>&1; then
  echo "[rlfoundry] note: the 'rlfoundry' command is not on PATH; use '$PY -m rlfoundry' instead" >&2
fi
