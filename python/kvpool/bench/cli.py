"""Command-line pieces the bench commands share: argument types, the replay flags, the settings record."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from typing import Any

from kvpool.bench import drivers
from kvpool.bench.trace import Dist

# Flags that parse one by one but cannot run together: raised by a command's checks before it runs,
# and reported by ``python -m kvpool.bench`` as a usage error (exit 2). argparse's own class, so that
# it is never mistaken for an error of the pool (every kvpool exception is a KVPoolError).
UsageError = argparse.ArgumentTypeError


def parse_size(text: str) -> int:
    """``1M`` -> 1048576, ``64K`` -> 65536, ``4096`` -> 4096."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 1M, 64K or 4096") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: a size must be positive, e.g. 1M, 64K or 4096")
    return n


def count(minimum: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number >= ``minimum`` (and <= ``maximum``, if given); anything else is a usage
    error that names the bound."""

    def conv(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one >= {minimum}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{n} is too small; give a whole number >= {minimum}")
        if maximum is not None and n > maximum:
            raise argparse.ArgumentTypeError(f"{n} is too large; give a whole number <= {maximum}")
        return n

    return conv


def fraction(*, zero: bool = False) -> Callable[[str], float]:
    """A share in (0, 1], or [0, 1] with ``zero``."""
    span = "[0, 1]" if zero else "(0, 1]"

    def conv(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a share in {span}") from None
        if not (0 <= x <= 1 if zero else 0 < x <= 1):
            raise argparse.ArgumentTypeError(f"{x:g} is outside {span}; give a share in {span}")
        return x

    return conv


def dist(text: str) -> Dist:
    """A length distribution (``Dist.parse``), its complaint as a usage error."""
    try:
        return Dist.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (e.g. 64:4096 or 512)") from None


def list_of(conv: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A comma-separated list of ``conv`` values (``1M,16M``), at least one."""

    def parse(text: str) -> list[Any]:
        values = [conv(x) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r} names nothing; give one value or more, comma-separated")
        return values

    return parse


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


def output_files(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, path) of every file the run will write: --json, --plot, overhead's --json-prefix files."""
    out = getattr(args, "out", ".")
    names = [(f"--{k}", getattr(args, k)) for k in ("json", "plot") if getattr(args, k, "")]
    prefix = getattr(args, "json_prefix", "")
    if prefix:
        names += [("--json-prefix", f"{prefix}-{section}.json") for section in args.sections]
    return [(flag, os.path.join(out, name)) for flag, name in names]


def check_outputs(args: argparse.Namespace, files: list[tuple[str, str]] | None = None) -> str | None:
    """Why the run could not write its files or read --reuse (None: it can), found before a run of
    minutes ends in a traceback and no figures. ``files``: (flag, path) pairs, by default
    ``output_files(args)``."""
    reuse = getattr(args, "reuse", "")
    if reuse and not os.path.isfile(os.path.join(args.out, reuse)):
        return (f"--reuse {reuse}: no file {os.path.join(args.out, reuse)!r}; give an earlier run's JSON "
                "(a name under --out, or an absolute path)")
    seen: dict[str, str] = {}
    for flag, path in output_files(args) if files is None else files:
        real = os.path.realpath(path)
        if real in seen:
            return f"{seen[real]} and {flag} both name {path!r}; give each output its own file"
        seen[real] = flag
        if os.path.isdir(path) or path.endswith(os.sep):
            return f"{flag}: {path!r} is a directory; give a file name (a bare name goes under --out)"
        folder = os.path.dirname(os.path.abspath(path))
        made = []  # the folders this check makes, removed again: a check leaves nothing behind
        try:
            missing = folder
            while not os.path.exists(missing):
                made.append(missing)
                missing = os.path.dirname(missing)
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            return (f"{flag}: cannot write {path!r}: no new file can be made in {folder!r} ({e.strerror}); give "
                    "--out a writable directory")
        finally:
            for d in made:
                try:
                    os.rmdir(d)
                except OSError:
                    break
    return None


def add_replay_arguments(p: argparse.ArgumentParser, workload: str, *, pools: str,
                         steps: tuple[int, str], warmup: tuple[int, str], pages: str = "1,16") -> None:
    """The flags every replayed workload takes; ``steps`` and ``warmup`` are (default, help)."""
    p.add_argument("--pool-sizes", type=list_of(parse_size), default=list_of(parse_size)(pools),
                   help=f"pool sizes in slots (default {pools})")
    p.add_argument("--page-sizes", type=list_of(count(1)), default=list_of(int)(pages), help=f"default {pages}")
    names = drivers.names(workload)
    p.add_argument("--allocators", type=list_of(one_of(names, "allocator")), default=names,
                   help=f"subset of {','.join(names)}")
    p.add_argument("--steps", type=count(1), default=steps[0], help=steps[1])
    p.add_argument("--warmup", type=count(0), default=warmup[0], help=warmup[1])
    p.add_argument("--seed", type=count(0), default=0, help="seeds the traces (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny pool and few steps: runs in seconds (tests, CI); flags given explicitly keep "
                        "their values")
    add_out_argument(p)
    p.add_argument("--json", default=f"{workload}.json", help="JSON output file, under --out ('' for none)")
    p.add_argument("--plot", default=f"{workload}.png", help="PNG output file, under --out ('' for none)")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's flags as the JSON file records them (``--reuse`` compares them)."""
    return {k: (str(v) if isinstance(v, Dist) else v) for k, v in vars(args).items() if k != "func"}


__all__ = ["UsageError", "add_out_argument", "add_replay_arguments", "check_outputs", "count", "dist", "fraction",
           "list_of", "one_of", "output_files", "parse_size", "settings"]
