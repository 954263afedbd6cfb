"""A prefix trace's allocator calls, recorded once and replayed bare, to compare two builds of
the core with less noise than ``python -m kvpool.bench prefix``.

    python benchmarks/prefix_replay.py record --scenario tiered --page-size 1 --steps 1000 calls.pkl
    python benchmarks/prefix_replay.py ab calls.pkl BUILD_A BUILD_B --rounds 5 [--json out.json]

``record`` runs kvpool's prefix driver (the calls of ``python -m kvpool.bench prefix``) and keeps
every allocator call with its arguments. ``ab`` replays them, alternating the two builds (each a
directory holding a ``kvpool`` package, as ``PYTHONPATH`` takes it) in fresh processes, and prints
the median µs a measured step of each call and their ratio B/A. A replay makes only the calls: no
trace generation or driver bookkeeping between them, so a profiler sees mostly the core, and a
long trace (a full pool, where every new token evicts one) costs seconds. The events are drained
after each step, as the driver drains them, and the drain is timed apart from the total. Both
builds must hand out the same rows: the handles are seeded, and a replay stops at the first
handle that differs from the recording.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

HANDLE_SEED = 7  # the same handles in every run and build
STEP, DRAIN = "<step>", "<drain>"  # markers between the recorded calls


def _driver(cfg: Any) -> Any:
    """kvpool's prefix driver, its allocator's handles seeded."""
    import kvpool
    from kvpool.bench.drivers.kvpool_prefix import KVPoolPrefixDriver

    class Driver(KVPoolPrefixDriver):
        def new_allocator(self) -> Any:
            c = self.cfg
            return kvpool.SlotAllocator(c.num_pages, c.page_size, c.concurrency, c.max_context_len,
                                        kv_events=c.kv_events, handle_seed=HANDLE_SEED)

    return Driver(cfg)


def record(scenario: str, page_size: int, steps: int, warmup: int, num_slots: int,
           kv_events: bool) -> dict[str, Any]:
    """Runs the prefix driver over a generated trace and returns its calls: (name, args,
    kwargs, measured, returned handles); the request table is passed as the marker
    ``"table"``."""
    from kvpool.bench.prefix.trace import PrefixTraceConfig, generate

    cfg = PrefixTraceConfig(scenario=scenario, num_slots=num_slots, page_size=page_size, steps=steps,
                            warmup=warmup, kv_events=kv_events)
    calls: list[tuple] = []
    measured = [False]

    class Recorder:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            f = getattr(self.inner, name)
            if not callable(f) or name == "take_events":
                return f

            def call(*args: Any, **kw: Any) -> Any:
                out = f(*args, **kw)
                args = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
                kw = {k: "table" if k == "table" else (v.copy() if isinstance(v, np.ndarray) else v)
                      for k, v in kw.items()}
                handles = out[0].copy() if name == "open_with_prefix" else None
                calls.append((name, args, kw, measured[0], handles))
                return out

            return call

    trace = generate(cfg)
    driver = _driver(cfg)
    driver.alloc = Recorder(driver.alloc)
    for i, s in enumerate(trace.steps):
        measured[0] = i >= cfg.warmup
        driver.run(driver.prepare(s))
        calls.append((STEP, (), {}, measured[0], None))
        if kv_events:
            calls.append((DRAIN, (), {}, False, None))
    return {"config": cfg, "calls": calls}


def replay(recording: dict[str, Any]) -> dict[str, float]:
    """Makes the recorded calls on a fresh allocator; returns µs a measured step per call
    (``extend`` split into the prompts' and the decode's), their total, and with events the
    drain after each step, apart from the total."""
    import gc

    driver = _driver(recording["config"])
    alloc, table = driver.alloc, driver.table
    ns: dict[str, int] = {}
    steps = drained = 0
    in_measured = False  # whether the step a drain follows was measured
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for name, args, kw, measured, handles in recording["calls"]:
            if name == STEP:
                steps += measured
                in_measured = measured
                continue
            if name == DRAIN:
                t = clock()
                alloc.take_events()
                drained += (clock() - t) * in_measured
                continue
            if "table" in kw:
                kw = dict(kw, table=table)
            f = getattr(alloc, name)
            t = clock()
            out = f(*args, **kw)
            dt = clock() - t
            if handles is not None and not np.array_equal(out[0], handles):
                raise SystemExit(f"{name} returned other handles than the recording: this build hands "
                                 "out rows differently, so the replay cannot go on")
            if measured:
                key = "decode extend" if name == "extend" and "tokens" in kw else name
                ns[key] = ns.get(key, 0) + dt
    finally:
        gc.enable()
    per = {k: v / max(steps, 1) / 1e3 for k, v in ns.items()}
    per["total"] = sum(per.values())
    if recording["config"].kv_events:
        # Apart from the total, as the bench drains untimed; an engine that
        # publishes events pays it every step.
        per["take_events (apart)"] = drained / max(steps, 1) / 1e3
    return per


def _with_build(build: str, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """``python argv`` in a fresh process whose PYTHONPATH is ``build``."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(build))
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, **kw)


def _last_error_line(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stderr.strip().splitlines() or ["(no output)"])[-1]


def _replay_in(build: str, path: str) -> dict[str, float]:
    done = _with_build(build, [__file__, "replay", path])
    if done.returncode:
        raise SystemExit(f"the replay with build {build} failed (exit {done.returncode}): {_last_error_line(done)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_problem(build: str) -> str | None:
    """Why ``build`` cannot be one side of ``ab`` (None: it can): a directory whose ``kvpool``
    package a fresh process imports from it. A directory without one let the process import
    another kvpool (an installed one) and the table named the directory for that build's figures."""
    pkg = os.path.join(os.path.abspath(build), "kvpool")
    if not os.path.isfile(os.path.join(pkg, "__init__.py")):
        return f"{build!r} holds no kvpool package ({pkg}/__init__.py); give a directory as PYTHONPATH takes it"
    # Run from this script's folder: ``-c`` puts the working directory first on sys.path, where a
    # replay (``python prefix_replay.py``) has this folder, so a kvpool package in the working
    # directory (a checkout's python/) would be found here and not by the replay.
    done = _with_build(build, ["-c", "import kvpool; print(kvpool.__file__)"],
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    if done.returncode:
        return f"{build!r}: its kvpool does not import ({_last_error_line(done)})"
    got = os.path.realpath(done.stdout.strip().splitlines()[-1])
    if os.path.dirname(got) != os.path.realpath(pkg):
        return f"{build!r}: a process with it as PYTHONPATH imports kvpool from {got}, not from it"
    return None


def _file_problem(path: str, what: str) -> str | None:
    """Why ``path`` cannot be written (None: it can), checked before a recording or the rounds run."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{what} {path!r} is a directory; give a file name"
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"{what} {path!r}: {folder!r} is not a writable directory; give a path in one"
    return None


def ab(path: str, build_a: str, build_b: str, rounds: int) -> dict[str, Any]:
    """Alternates replays of the two builds; medians per call and B/A."""
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for _ in range(rounds):
        runs["a"].append(_replay_in(build_a, path))
        runs["b"].append(_replay_in(build_b, path))
    keys = list(runs["a"][0])
    med = {w: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in keys} for w, rs in runs.items()}
    return {"builds": {"a": build_a, "b": build_b}, "rounds": rounds, "median_us": med,
            "ratio_b_over_a": {k: med["b"][k] / med["a"][k] if med["a"][k] else None for k in keys}}


def main(argv: list[str] | None = None) -> None:
    from kvpool.bench.cli import count, parse_size
    from kvpool.bench.prefix.trace import SCENARIOS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record a trace's calls into a file")
    r.add_argument("out")
    r.add_argument("--scenario", default="system", choices=SCENARIOS)
    r.add_argument("--page-size", type=count(1), default=1)
    r.add_argument("--steps", type=count(1), default=1000)
    r.add_argument("--warmup", type=count(0), default=200)
    r.add_argument("--num-slots", type=parse_size, default=1 << 20, help="pool size in slots (default 1M)")
    r.add_argument("--no-kv-events", dest="kv_events", action="store_false")
    a = sub.add_parser("ab", help="replay a recording with two builds, alternated")
    a.add_argument("calls")
    a.add_argument("build_a")
    a.add_argument("build_b")
    a.add_argument("--rounds", type=count(1), default=5)
    a.add_argument("--json", default=None, help="also write the medians and ratios here")
    one = sub.add_parser("replay", help="replay a recording once with the kvpool on sys.path (prints JSON)")
    one.add_argument("calls")
    args = p.parse_args(argv)
    # Every flag checked before a recording or a round runs: a usage error (exit 2), not a traceback.
    if args.cmd == "record":
        from kvpool.bench.prefix.trace import PrefixTraceConfig

        try:
            PrefixTraceConfig(scenario=args.scenario, num_slots=args.num_slots, page_size=args.page_size,
                              steps=args.steps, warmup=args.warmup)
        except ValueError as e:  # the trace's complaint names python -m kvpool.bench's flags
            r.error(str(e).replace("--pool-sizes", "--num-slots").replace("--page-sizes", "--page-size"))
        problem = _file_problem(args.out, "OUT")
        if problem:
            r.error(problem)
    elif args.cmd == "ab":
        if not os.path.isfile(args.calls):
            a.error(f"CALLS {args.calls!r} is no file; give a recording made by 'record'")
        problem = next(filter(None, [build_problem(args.build_a), build_problem(args.build_b)]), None)
        problem = problem or (_file_problem(args.json, "--json") if args.json else None)
        if problem:
            a.error(problem)

    if args.cmd == "record":
        rec = record(args.scenario, args.page_size, args.steps, args.warmup, args.num_slots, args.kv_events)
        with open(args.out, "wb") as f:
            pickle.dump(rec, f, protocol=pickle.HIGHEST_PROTOCOL)
        print(f"{len(rec['calls'])} calls of {args.scenario}, page {args.page_size}, {args.steps} measured "
              f"steps -> {args.out}")
    elif args.cmd == "replay":
        with open(args.calls, "rb") as f:
            print(json.dumps(replay(pickle.load(f))))
    else:
        res = ab(args.calls, args.build_a, args.build_b, args.rounds)
        med, ratio = res["median_us"], res["ratio_b_over_a"]
        print(f"µs a measured step, medians of {args.rounds} alternated rounds (A: {args.build_a}, "
              f"B: {args.build_b})")
        for k in med["a"]:
            r_ = ratio[k]
            print(f"  {k:20s} A {med['a'][k]:9.2f}  B {med['b'][k]:9.2f}  B/A "
                  f"{'-' if r_ is None else f'{r_:.3f}'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
