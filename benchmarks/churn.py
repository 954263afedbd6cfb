"""Thin script for ``python -m kvpool.bench churn`` (same arguments): kvpool vs SGLang and vLLM.

    python benchmarks/churn.py                 # full run, writes benchmarks/results/churn.{json,png}
    python benchmarks/churn.py --quick         # seconds; tiny pools
    python benchmarks/churn.py ops --quick     # the single-operation benchmarks instead
    python benchmarks/churn.py prefix          # prefix caching: writes benchmarks/results/prefix.{json,png}
    python benchmarks/churn.py hybrid --quick  # any other command of python -m kvpool.bench, the same way
"""

import sys
from pathlib import Path

from kvpool.bench.__main__ import COMMANDS, main

RESULTS = Path(__file__).resolve().parent / "results"


def bench_argv(argv: list[str]) -> list[str]:
    """``argv`` for ``python -m kvpool.bench``: ``churn`` when it names no command, and
    ``--out`` this checkout's results folder unless it gives one."""
    argv = list(argv)
    at = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    if at is None:
        at = 0
        while at < len(argv) and argv[at].startswith("--torch-threads"):  # the one option before a command
            at += 1 if "=" in argv[at] else 2
        argv.insert(at, "churn")
    # This checkout's results folder, unless --out says otherwise (the installed
    # `python -m kvpool.bench` writes under the current directory instead).
    if not any(a == "--out" or a.startswith("--out=") for a in argv[at + 1:]):
        argv[at + 1:at + 1] = ["--out", str(RESULTS)]
    return argv


if __name__ == "__main__":
    sys.exit(main(bench_argv(sys.argv[1:])))
