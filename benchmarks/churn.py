"""Thin script for ``python -m kvpool.bench churn`` (same arguments): kvpool vs SGLang and vLLM.

    python benchmarks/churn.py                 # full run, writes benchmarks/results/churn.{json,png}
    python benchmarks/churn.py --quick         # seconds; tiny pools
    python benchmarks/churn.py ops --quick     # the single-operation benchmarks instead
"""

import sys

from kvpool.bench.__main__ import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not argv or argv[0] not in ("churn", "ops"):
        argv = ["churn", *argv]
    sys.exit(main(argv))
