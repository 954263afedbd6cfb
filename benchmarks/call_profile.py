"""cProfile of one method's calls and nothing around them (``hf_split --profile``, ``gpu_host
--profile``): on a GPU box, where no other profiler is at hand, which functions a call's host
time goes to, by own time and by time inside, in µs."""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable
from typing import Any


def profile_calls(owner: Any, name: str, run: Callable[[], Any], top: int) -> dict[str, str]:
    """Run ``run()`` with the profiler on only inside ``owner.name``'s calls; return (and print)
    the ``top`` functions by own time and by time inside."""
    prof = cProfile.Profile()
    method = getattr(owner, name)

    def profiled(*args: Any, **kwargs: Any) -> Any:
        prof.enable()
        try:
            return method(*args, **kwargs)
        finally:
            prof.disable()

    setattr(owner, name, profiled)
    try:
        run()
    finally:
        setattr(owner, name, method)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]  # {(file, line, name): (prim, calls, own s, inside s, callers)}
    out = {}
    for key, col in (("own", 2), ("inside", 3)):
        rows = sorted(stats.items(), key=lambda kv: -kv[1][col])[:top]
        lines = [f"{owner.__name__}.{name}, by {key} time: calls, own us, inside us, inside us per call, function"]
        for (file, line, func), (_, calls, own, inside, _) in rows:
            where = func if file == "~" else f"{'/'.join(file.split('/')[-2:])}:{line}({func})"
            lines.append(f"{calls:7d} {own * 1e6:10.0f} {inside * 1e6:10.0f} {inside * 1e6 / calls:8.1f}  {where}")
        out[key] = "\n".join(lines)
        print(out[key])
    return out
