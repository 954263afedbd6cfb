"""Command-line pieces the bench commands share: argument types, the replay flags, the settings record."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from kvpool.bench import drivers
from kvpool.bench.trace import Dist


def parse_size(text: str) -> int:
    """``1M`` -> 1048576, ``64K`` -> 65536, ``4096`` -> 4096."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 1M, 64K or 4096") from None


def list_of(conv: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A comma-separated list of ``conv`` values (``1M,16M``)."""
    return lambda text: [conv(x) for x in text.split(",") if x.strip()]


def one_of(choices: list[str], what: str) -> Callable[[str], str]:
    """A name from ``choices``: a misspelt one is a usage error that lists them, before anything runs."""

    def conv(text: str) -> str:
        name = text.strip()
        if name not in choices:
            raise argparse.ArgumentTypeError(f"unknown {what} {name!r}; choose from {','.join(choices)}")
        return name

    return conv


def add_out_argument(p: argparse.ArgumentParser) -> None:
    """``--out DIR``: where a benchmark writes its files (never a path inside the package)."""
    p.add_argument("--out", default=".", metavar="DIR",
                   help="directory for the JSON / PNG outputs (default: the current directory; created "
                        "if missing); absolute --json / --plot paths are used as given")


def add_replay_arguments(p: argparse.ArgumentParser, workload: str, *, pools: str,
                         steps: tuple[int, str], warmup: tuple[int, str], pages: str = "1,16") -> None:
    """The flags every replayed workload takes; ``steps`` and ``warmup`` are (default, help)."""
    p.add_argument("--pool-sizes", type=list_of(parse_size), default=list_of(parse_size)(pools),
                   help=f"pool sizes in slots (default {pools})")
    p.add_argument("--page-sizes", type=list_of(int), default=list_of(int)(pages), help=f"default {pages}")
    names = drivers.names(workload)
    p.add_argument("--allocators", type=list_of(one_of(names, "allocator")), default=names,
                   help=f"subset of {','.join(names)}")
    p.add_argument("--steps", type=int, default=steps[0], help=steps[1])
    p.add_argument("--warmup", type=int, default=warmup[0], help=warmup[1])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny pool and few steps: runs in seconds (tests, CI)")
    add_out_argument(p)
    p.add_argument("--json", default=f"{workload}.json", help="JSON output file, under --out ('' for none)")
    p.add_argument("--plot", default=f"{workload}.png", help="PNG output file, under --out ('' for none)")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's flags as the JSON file records them (``--reuse`` compares them)."""
    return {k: (str(v) if isinstance(v, Dist) else v) for k, v in vars(args).items() if k != "func"}


__all__ = ["add_out_argument", "add_replay_arguments", "list_of", "one_of", "parse_size", "settings"]
