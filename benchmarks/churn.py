"""Thin script for ``python -m kvpool.bench churn`` (same arguments): kvpool vs SGLang and vLLM.

    python benchmarks/churn.py                 # full run, writes benchmarks/results/churn.{json,png}
    python benchmarks/churn.py --quick         # seconds; tiny pools
    python benchmarks/churn.py ops --quick     # the single-operation benchmarks instead
    python benchmarks/churn.py prefix          # prefix caching: writes benchmarks/results/prefix.{json,png}
"""

import sys
from pathlib import Path

from kvpool.bench.__main__ import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not argv or argv[0] not in ("churn", "ops", "prefix"):
        argv = ["churn", *argv]
    # This checkout's results folder, unless --out says otherwise (the installed
    # `python -m kvpool.bench` writes under the current directory instead).
    if "--out" not in argv:
        argv = [argv[0], "--out", str(RESULTS), *argv[1:]]
    sys.exit(main(argv))
