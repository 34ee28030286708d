#!/usr/bin/env bash
# Run the whole test suite; extra arguments go to pytest. pytest's "no tests collected" (exit 5)
# counts as a failure: an empty run proves nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# --durations: the slowest tests in every run's log, where CI time is trimmed from
"$PY" -m pytest tests -q --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "[rlfoundry] pytest collected no tests" >&2; exit 1; fi
exit "$rc"
