"""rlfoundry vs the hand-written GRPO floor (``benchmarks/floor_grpo.py``): the framework's overhead.

    python -m benchmarks.floor_vs_rlfoundry [--response-lengths 64 256 --steps N --repeats R]

The same script as ``benchmarks.vs_trl`` with ``--frameworks rlfoundry floor`` (add ``trl`` to get
all three); writes ``benchmarks/results/floor_vs_rlfoundry.json``. The ratio to read is
``rlfoundry/floor step_s`` (target <= 1.15).
"""

from __future__ import annotations

from benchmarks.vs_trl import main as _compare


def main(argv=None):
    return _compare(argv, default_frameworks=("rlfoundry", "floor"), name="floor_vs_rlfoundry")


if __name__ == "__main__":
    main()
