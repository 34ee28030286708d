#!/usr/bin/env bash
# Run the SGLang-marked tests inside the SGLang environment built by scripts/setup_sglang_cpu.sh.
#   bash scripts/test_sglang.sh [pytest args]      (SGLANG_VENV=... to use another environment)
# Exit code 5 (nothing collected) counts as a failure, and so does a missing SGLang: these tests skip
# themselves without SGLang, and an all-skipped run here would prove nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-.venv-sglang}
VPY="$VENV/bin/python"
# SGLang decides "CPU engine" when it is first imported
export SGLANG_USE_CPU_ENGINE=${SGLANG_USE_CPU_ENGINE:-1}
if ! "$VPY" -c "import sglang" >/dev/null 2>&1; then
  echo "[rlfoundry] no SGLang in $VENV; build it with: bash scripts/setup_sglang_cpu.sh" >&2
  exit 1
fi
"$VPY" -m pytest tests/workers/test_sglang_rollout.py tests/workers/test_sglang_vision.py tests/workers/test_rollout_contract.py -m sglang -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "[rlfoundry] pytest collected no SGLang tests" >&2; exit 1; fi
exit "$rc"
