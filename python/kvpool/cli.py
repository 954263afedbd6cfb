"""The ``kvpool`` command: ``kvpool demo [...]`` runs the demo engine."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: kvpool demo [options]   (kvpool demo --help for the options)
       kvpool --version

commands:
  demo    serve synthetic requests with continuous batching on a KVPool"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # a usage error: on stderr, as argparse reports one
        print(f"kvpool: give a command\n{USAGE}", file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if args[0] == "--version":
        from kvpool import __version__

        print(f"kvpool {__version__}")
        return 0
    if args[0] == "demo":
        try:
            from kvpool.demo.cli import main as demo_main
        except ModuleNotFoundError as e:  # kvpool installed without its torch dependency
            if e.name != "torch":
                raise
            print("kvpool demo: needs torch, which is not installed: pip install 'torch>=2.4'", file=sys.stderr)
            return 1
        return demo_main(args[1:])
    print(f"kvpool: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
    return 2
