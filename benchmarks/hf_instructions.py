"""Instructions a transformers cache's ``update`` calls execute in ``generate``-shaped decoding,
counted by valgrind's callgrind: a figure that does not move with the host's load.

On the shared 2-core VMs a ``KVPoolCache`` change worth 1-2% of its host time is invisible in
wall clock (``bench overhead --sections hf`` moves by +-3% between back-to-back runs). This runs
the same calls as ``kvpool.bench.hf_generate.update_us`` (a prompt's prefill, then one token a
row per step through every layer, under inference mode) for a few warm-up generates, then counts
the instructions of ``--generates`` more, and nothing around them: a small C library (built here
with ``cc`` against valgrind's ``callgrind.h``) toggles collection on and off around them. The
count includes making each step's K/V (``torch.randn``, the same for every cache).

    python benchmarks/hf_instructions.py --batch 1 --batch 8    # kvpool and dynamic, each batch

``--scope generate`` counts whole ``model.generate`` calls instead (the random Llama of
``bench overhead --sections hf``, prefill, attention and sampling included), the figure that
says whether a gap in tokens/s is work at all; ``--cache-sim`` adds callgrind's simulated
cache misses and branch mispredictions (several times slower).

Needs ``valgrind`` and a C compiler; takes about a minute a run. ``--out`` writes JSON. A/B a
change by running it in two checkouts (the numbers are deterministic to ~0.1% with the same
torch and ``PYTHONHASHSEED``, which it sets).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

TOGGLE_C = "#include <valgrind/callgrind.h>\nvoid kv_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }\n"

# ``--cache-sim``'s figures, as valgrind's summary names them (totals of what was collected).
SIMULATED = {"i1_misses": "I1  misses", "d1_misses": "D1  misses", "mispredicts": "Mispredicts"}


def child(batch: int, cache: str, generates: int, lib: str, scope: str = "update") -> None:
    """Runs under callgrind: warm up, then count ``generates`` generates' cache calls, or with
    ``scope="generate"`` whole ``model.generate`` calls (``lib``: the toggle library, or ``-``
    for none; outside valgrind the toggle does nothing)."""
    import ctypes

    import torch
    from transformers import DynamicCache

    from kvpool.bench.hf_generate import HFSettings, _Closing, build_model, run_once
    from kvpool.integrations.transformers import KVPoolCache, pool_for_model

    torch.set_num_threads(1)
    s = HFSettings(batches=(batch,))
    model = build_model(s)
    ctx = s.prompt_len + s.new_tokens
    # As in the overhead bench: one pool for batches up to 8.
    pool = pool_for_model(model, max_tokens=max(batch, 8) * ctx + 64, page_size=s.page_size,
                          max_requests=max(batch, 8), max_context_len=ctx)
    hd = s.hidden // s.heads
    g = torch.Generator().manual_seed(s.seed)

    # (Drawn only for whole generates: the update scope's K/V stay the draws they were.)
    ids = torch.randint(3, s.vocab, (batch, s.prompt_len), generator=g) if scope == "generate" else None

    def generate() -> None:
        make = (lambda: KVPoolCache(pool)) if cache == "kvpool" else (
            lambda: _Closing(DynamicCache(config=model.config)))
        if scope == "generate":
            with make() as c:
                run_once(model, ids, c, s.new_tokens)
            return
        with torch.inference_mode(), make() as c:
            kv = torch.randn(batch, s.kv_heads, s.prompt_len, hd, generator=g)
            for layer in range(s.layers):
                c.update(kv, kv, layer)
            one = torch.randn(batch, s.kv_heads, 1, hd, generator=g)
            for _ in range(s.new_tokens - 1):
                for layer in range(s.layers):
                    c.update(one, one, layer)

    for _ in range(3):
        generate()
    toggle = ctypes.CDLL(lib).kv_toggle if lib != "-" else (lambda: None)
    toggle()
    for _ in range(generates):
        generate()
    toggle()


def main(argv: list[str] | None = None) -> None:
    from kvpool.bench.cli import count

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=count(1), action="append", help="repeat for several (default: 1 and 8)")
    ap.add_argument("--cache", action="append", choices=("kvpool", "dynamic"),
                    help="repeat for both (default: both)")
    ap.add_argument("--generates", type=count(1), default=5)
    ap.add_argument("--scope", choices=("update", "generate"), default="update",
                    help="count the cache's update calls (default) or whole generate calls")
    ap.add_argument("--cache-sim", action="store_true",
                    help="also simulated cache misses and branch mispredictions")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=3, metavar=("BATCH", "CACHE", "LIB"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(int(a.child[0]), a.child[1], a.generates, a.child[2], a.scope)
        return
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            sys.exit(f"hf_instructions needs {tool} on PATH")
    batches, caches = a.batch or [1, 8], a.cache or ["kvpool", "dynamic"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "toggle.c"), os.path.join(tmp, "libkvtoggle.so")
        with open(src, "w") as f:
            f.write(TOGGLE_C)
        subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
        env = dict(os.environ, PYTHONHASHSEED="0")
        for batch in batches:
            for cache in caches:
                sim = ["--cache-sim=yes", "--branch-sim=yes"] if a.cache_sim else []
                out = subprocess.run(
                    ["valgrind", "--tool=callgrind", "--collect-atstart=no", *sim,
                     f"--callgrind-out-file={os.path.join(tmp, 'cg.out')}", sys.executable, __file__,
                     "--generates", str(a.generates), "--scope", a.scope, "--child", str(batch), cache, lib],
                    env=env, capture_output=True, text=True, check=True)
                got = re.search(r"Collected : (\d+)", out.stderr)
                if got is None:
                    sys.exit(f"no callgrind total in:\n{out.stderr[-2000:]}")
                n = int(got.group(1))
                row = {"batch": batch, "cache": cache, "instructions": n, "per_generate": n / a.generates}
                line = f"batch {batch} {cache:8s} {n / a.generates / 1e6:8.2f} M instructions"
                for key, label in SIMULATED.items() if a.cache_sim else ():
                    m = re.search(rf"{re.escape(label)}:\s+([\d,]+)", out.stderr)
                    if m is not None:
                        row[key] = int(m.group(1).replace(",", ""))
                        line += f", {row[key] / a.generates / 1e6:.2f} M {key.replace('_', ' ')}"
                results.append(row)
                print(f"{line} per generate ({a.scope}; 64 tokens, 4 layers; {a.generates} counted)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"benchmark": "hf_instructions", "scope": a.scope, "generates": a.generates,
                       "results": results}, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
