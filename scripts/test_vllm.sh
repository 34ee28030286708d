#!/usr/bin/env bash
# Run the vLLM-marked tests inside the vLLM environment built by scripts/setup_vllm_cpu.sh.
#   bash scripts/test_vllm.sh [pytest args]      (VLLM_VENV=... to use another environment)
# Exit code 5 (nothing collected) counts as a failure, and so does a missing vLLM: these tests skip
# themselves without vLLM, and an all-skipped run here would prove nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
VPY="$VENV/bin/python"
if ! "$VPY" -c "import vllm" >/dev/null 2>&1; then
  echo "[rlfoundry] no vLLM in $VENV; build it with: bash scripts/setup_vllm_cpu.sh" >&2
  exit 1
fi
# In-process engine core (the hybrid engine needs it); a small CPU KV cache unless the caller set one.
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
"$VPY" -m pytest tests/workers/test_vllm_rollout.py tests/workers/test_vllm_vision.py tests/workers/test_rollout_contract.py -m vllm -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "[rlfoundry] pytest collected no vLLM tests" >&2; exit 1; fi
exit "$rc"
