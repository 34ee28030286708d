#!/usr/bin/env bash
# Run the whole test suite; extra arguments go to pytest. pytest's "no tests collected" (exit 5)
# counts as a failure: an empty run proves nothing.
#
# Without arguments, and with pytest-xdist installed (the `test` extra), the suite runs in two passes:
# every test not marked `serial` on RLFOUNDRY_TEST_WORKERS processes (default: the cores, at most 4; each
# test keeps one intra-op thread, tests/conftest.py), whole files per process (their module fixtures are
# built once), then the `serial` ones alone (they diff the host's state, or hold a time limit that
# another test's load would break). With arguments, or RLFOUNDRY_TEST_WORKERS=1, one pass as given.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
workers=${RLFOUNDRY_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 1); echo $(( n < 4 ? n : 4 )))}
# --durations: the slowest tests in every run's log, where CI time is trimmed from
run() { "$PY" -m pytest tests -q --durations=25 "$@"; }
if [ "$#" -eq 0 ] && [ "$workers" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
  # -m replaces pyproject's addopts marker expression, so `heavy` stays out here by name
  run -n "$workers" --dist loadfile -m "not heavy and not serial"; rc=$?
  run -m "serial and not heavy"; rc2=$?
  [ "$rc" -eq 0 ] && rc=$rc2
else
  run "$@"; rc=$?
fi
if [ "$rc" -eq 5 ]; then echo "[rlfoundry] pytest collected no tests" >&2; exit 1; fi
exit "$rc"
