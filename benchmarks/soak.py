"""Soak: churn one KVPool from several threads for N minutes while sampling
the process RSS and the allocator's ``metadata_bytes``.

Each worker thread opens requests, grows them by random prompt/decode counts
(writing K/V rows for every new slot), truncates and closes them, and checks
that its own view of every request's slots agrees with the allocator. Every
other worker also shares pages: it opens requests on one of a few shared
system prompts with ``open_with_prefix`` (prompt tokens known, decode tokens
passed as ``tokens=``), publishes pages with ``cache``, forks requests (so
extends copy-on-write shared last pages), and closes with ``cache=True``, so
the prefix index, LRU eviction under pressure and the copy queue churn too.
The main thread samples every ``--sample-s`` seconds, runs ``check()`` and
drains the KV events.

Warm-up first drives every request row's page list to the largest capacity
any growth history can give it (see ``saturate_rows``), then churns for the
first ``--warmup-frac`` of the time. After warm-up:

* ``metadata_bytes`` must not climb: the end above the peak of the middle third
  after warm-up, and that above the peak of the first third, each by more than
  ``WOBBLE_BYTES`` (hash maps' capacity() wobbles with tombstones). The core's buffers
  keep their capacity (a row's prompt buffer, the event log and the copy queue
  across drains; the prefix index is bounded by the pool), so after
  ``saturate_rows`` it holds still but for one step at most: a hash map of the
  prefix index's ghosts doubles when more removed entries with children exist
  at once than ever before, which in a minute's churn can come after warm-up
  (about one soak in four here). A leak climbs through every window;
* RSS must not grow by more than ``max(--rss-slack-mib, 2 %)`` (the median of
  the last three samples against the median of the first three after warm-up);
* ``check()`` must pass every time, and no worker may see a lost or doubled slot.

Exit status 1 on any failure. Figures go to stdout and, with ``--json``, to a file.

Usage: python benchmarks/soak.py --minutes 1 [--threads 4] [--json bench_out/soak.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

import kvpool
from kvpool import PoolExhaustedError, TooManyRequestsError
from kvpool.bench.cli import check_outputs, count
from kvpool.bench.report import write_json


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# How far metadata_bytes may wobble without a leak: the ghost maps are hash maps, whose
# capacity() counts the slots removals left as tombstones out (down by a few hundred bytes
# as ghosts come and go) and back in when a rehash in place clears them (a CI soak: a step
# of 5.4 KB, the drift down, then a step of 0.8 KB, read as a climb). A leak of even a
# byte a call grows by hundreds of KB in a minute's churn.
WOBBLE_BYTES = 16 << 10


def metadata_climb(values: list[int]) -> str | None:
    """Why ``metadata_bytes`` sampled after warm-up (at least 6 values) looks like a leak, or None.

    A leak climbs on and on: the middle third's peak above the first's, and the end (the median
    of the last three) above that, each by more than ``WOBBLE_BYTES``. A bounded table may still
    reach a new high-water mark once after warm-up (the ghost maps are hash maps, whose capacity
    doubles when more removed entries with children exist at once than ever before), which is
    one step, not a climb."""
    third = max(3, len(values) // 3)
    first = max(values[:third])
    mid = max(values[third : 2 * third] or values[:third])
    end = statistics.median(values[-3:])
    if end > mid + WOBBLE_BYTES and mid > first + WOBBLE_BYTES:
        return f"metadata_bytes climbed after warm-up: early peak {first}, then {mid}, end {end}"
    return None


def make_pool(threads: int) -> kvpool.KVPool:
    return kvpool.KVPool(2, 2, 16, dtype=torch.float16, page_size=4, num_pages=4096,
                         max_requests=16 * threads, max_context_len=512)


def saturate_rows(pool: kvpool.KVPool) -> None:
    """Drive every row's page list to the largest capacity any history can give it.

    A row's page Vec never shrinks, and its capacity depends on how it grew
    (one call to 127 pages reserves exactly 127; one more page then doubles
    it). So each row grows to one page short of max_context_len in a single
    call and then by one more page: the worst case. All rows are held open at
    once (a closed row is reopened first, so open/close cycles would keep
    reusing the same few rows), a chunk at a time as free pages allow.
    """
    ps, ctx = pool.page_size, pool.max_context_len
    handles = pool.open(pool.max_requests)
    per_chunk = max(1, pool.allocator.free_pages // -(-ctx // ps))
    for i in range(0, len(handles), per_chunk):
        chunk = handles[i : i + per_chunk]
        pool.extend(chunk, max(ctx - ps, 0))
        pool.extend(chunk, ctx - max(ctx - ps, 0))
        pool.truncate(chunk, 0)
    pool.close(handles)
    pool.reset()
    # Every row's prompt buffer keeps its largest size (see RowCold::set_prompt),
    # so every row holds a max_context_len prompt once, all at the same time
    # (opening takes no page).
    rng = np.random.default_rng(7)
    n = pool.max_requests
    hs, _ = pool.open_with_prefix(rng.integers(0, 10**6, size=n * ctx), [ctx] * n)
    pool.close(hs)
    # The prefix index and event buffer grow to hold every page of the pool
    # (registering distinct prompts evicts the oldest).
    for _ in range(2):
        for i in range(0, pool.max_requests, per_chunk):
            n = min(per_chunk, pool.max_requests - i)
            hs, cached = pool.open_with_prefix(rng.integers(0, 10**6, size=n * ctx), [ctx] * n)
            pool.extend(hs, ctx - cached)
            pool.close(hs, cache=True)
    pool.take_events()
    pool.clear_cache()
    pool.take_events()


#: Shared system prompts of the sharing workers (token ids; 2-4 pages and a bit).
PROMPTS = [np.random.default_rng(100 + i).integers(0, 1000, size=n) for i, n in enumerate((37, 70, 110, 150))]


class Worker(threading.Thread):
    def __init__(self, pool: kvpool.KVPool, seed: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.pool, self.rng, self.stop = pool, np.random.default_rng(seed), stop
        self.sharing = seed % 2 == 1
        self.mine: dict[int, list[int]] = {}
        # Requests whose pages may be shared: copy-on-write can move their last
        # page, so their slots are re-read from the pool after each extend.
        self.shared: set[int] = set()
        # Sharing requests' known token ids (prompt, or everything a fork
        # inherited): truncating below them and extending with other ids is a
        # typed error by design, so truncates stop at this floor.
        self.floor: dict[int, int] = {}
        self.ops = 0
        self.error: BaseException | None = None
        # Enough rows for the largest batch: up to 10 requests x 128 new tokens.
        self.rows = torch.ones(16 * 128, pool.num_kv_heads, pool.head_dim, dtype=pool.dtype)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.step()
        except BaseException as e:  # reported by the main thread
            self.error = e
        finally:
            if self.mine:
                self.pool.close(np.fromiter(self.mine, dtype=np.int64))

    def open_some(self) -> None:
        pool, rng, mine = self.pool, self.rng, self.mine
        try:
            if not self.sharing or rng.random() < 0.3:
                for h in pool.open(int(rng.integers(1, 4))):
                    mine[int(h)] = []
                return
            picks = rng.integers(0, len(PROMPTS), size=int(rng.integers(1, 3)))
            prompts = [np.concatenate([PROMPTS[i], rng.integers(0, 1000, size=int(rng.integers(1, 20)))])
                       for i in picks]
            hs, cached = pool.open_with_prefix(np.concatenate(prompts), [len(p) for p in prompts])
        except (TooManyRequestsError, PoolExhaustedError):
            return
        for h, c, p in zip(hs.tolist(), cached.tolist(), prompts):
            slots = pool.slots(h).tolist()
            if len(slots) != c:
                raise AssertionError(f"request {h}: {len(slots)} slots after a {c}-token prefix hit")
            mine[h] = slots
            self.shared.add(h)
            try:  # the rest of the prompt (tokens known from open_with_prefix)
                pool.extend([h], len(p) - c)
            except PoolExhaustedError:
                # Later extends would pass random tokens where the prompt's are known.
                pool.close([h])
                del mine[h]
                self.shared.discard(h)
                self.floor.pop(h, None)
                continue
            mine[h] = pool.slots(h).tolist()
            self.floor[h] = len(p)
        live = [h for h in hs.tolist() if h in mine]
        if live:
            pool.cache(live)

    def step(self) -> None:
        pool, rng, mine = self.pool, self.rng, self.mine
        if len(mine) < 8:
            self.open_some()
        if not mine:
            return
        hs = np.fromiter(mine, dtype=np.int64)
        room = pool.max_context_len - np.array([len(mine[int(h)]) for h in hs])
        prefill = rng.random() < 0.2
        counts = np.minimum(room, rng.integers(1, 129, size=len(hs)) if prefill else 1)
        tokens = rng.integers(0, 1000, size=int(counts.sum())) if self.sharing else None
        try:
            res = pool.extend(hs, counts, tokens=tokens)
        except PoolExhaustedError:
            res = None
        if res is not None:
            k = 0
            for h, c in zip(hs.tolist(), counts.tolist()):
                new = res.slots[k : k + c].tolist()
                if h in self.shared:
                    now = pool.slots(h).tolist()
                    if now[len(now) - c :] != new or len(now) != len(mine[h]) + c:
                        raise AssertionError(f"request {h}: extend's slots are not its new tail")
                    mine[h] = now
                else:
                    mine[h] += new
                k += c
            n = len(res.slots)
            pool.write(int(rng.integers(0, pool.num_layers)), res.slots, self.rows[:n], self.rows[:n])
        if self.sharing:
            pool.cache(hs)
            pool.take_events()  # a router would consume these; undrained they pile up
        h = int(rng.choice(hs))
        r = rng.random()
        if r < 0.1 or len(mine[h]) >= pool.max_context_len:
            pool.close([h], cache=self.sharing)
            del mine[h]
            self.shared.discard(h)
            self.floor.pop(h, None)
        elif self.sharing and r < 0.13 and len(mine) < 10:
            try:
                kids = pool.fork(h, int(rng.integers(1, 3)))
            except TooManyRequestsError:
                kids = []
            for kid in kids.tolist() if len(kids) else []:
                mine[kid] = list(mine[h])
                self.shared.add(kid)
                self.floor[kid] = len(mine[h])
            self.shared.add(h)
        elif r < 0.2:
            keep = int(rng.integers(min(self.floor.get(h, 0), len(mine[h])), len(mine[h]) + 1))
            pool.truncate([h], keep)
            del mine[h][keep:]
        elif r < 0.25 and pool.allocator.slots(h).tolist() != mine[h]:
            raise AssertionError(f"request {h}: the allocator's slots differ from what was handed out")
        self.ops += 1


def _number(text: str, zero: bool) -> float:
    bound = ">= 0" if zero else "> 0"
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one {bound}") from None
    if not (x >= 0 if zero else x > 0) or x == float("inf"):
        raise argparse.ArgumentTypeError(f"{x:g} must be finite and {bound}")
    return x


def _positive(text: str) -> float:
    return _number(text, zero=False)


def _non_negative(text: str) -> float:
    return _number(text, zero=True)


def _warmup_frac(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a share in [0, 1)") from None
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"{x:g} is outside [0, 1): the leak checks need time after warm-up")
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=_positive, required=True)
    ap.add_argument("--threads", type=count(1), default=4)
    ap.add_argument("--sample-s", type=_positive, default=2.0)
    ap.add_argument("--warmup-frac", type=_warmup_frac, default=0.25,
                    help="share of --minutes before the leak checks start, in [0, 1) (default 0.25)")
    ap.add_argument("--rss-slack-mib", type=_non_negative, default=4.0,
                    help="RSS growth allowed after warm-up, MiB, or 2%% of RSS if more (default 4)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    problem = check_outputs(args)  # before minutes of churn, not after
    if problem:
        ap.error(problem)

    torch.set_num_threads(1)
    pool = make_pool(args.threads)
    saturate_rows(pool)
    stop = threading.Event()
    workers = [Worker(pool, seed, stop) for seed in range(args.threads)]
    t0 = time.monotonic()
    total = args.minutes * 60
    warm_end = t0 + total * args.warmup_frac
    samples: list[dict[str, Any]] = []
    failures: list[str] = []
    for w in workers:
        w.start()
    try:
        while (now := time.monotonic()) - t0 < total:
            time.sleep(min(args.sample_s, max(0.0, total - (now - t0))))
            pool.take_events()  # a router would consume these; undrained they pile up
            try:
                pool.allocator.check()
            except kvpool.KVPoolError as e:
                failures.append(f"check() failed: {e}")
                break
            s = {"t": round(time.monotonic() - t0, 1), "rss": rss_bytes(),
                 "metadata": pool.allocator.metadata_bytes, "ops": sum(w.ops for w in workers),
                 "warm": time.monotonic() >= warm_end}
            samples.append(s)
            print(f"t={s['t']:7.1f}s ops={s['ops']:>10} rss={s['rss'] / 2**20:8.1f} MiB "
                  f"metadata={s['metadata']} B{'' if s['warm'] else ' (warm-up)'}", flush=True)
            if any(w.error for w in workers):
                break
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
    failures += [f"worker {i}: {w.error!r}" for i, w in enumerate(workers) if w.error]
    pool.allocator.check()
    result_cached = pool.cached_pages
    pool.clear_cache()
    pool.allocator.check()
    if pool.allocator.open_requests != 0 or pool.allocator.free_pages != pool.allocator.capacity_pages:
        failures.append("pages or rows leaked after every worker closed its requests")

    warm = [s for s in samples if s["warm"]]
    result: dict[str, Any] = {"minutes": args.minutes, "threads": args.threads,
                              "ops": sum(w.ops for w in workers), "samples": samples,
                              "cached_pages_at_end": result_cached, "hit_tokens": pool.hit_tokens,
                              "miss_tokens": pool.miss_tokens}
    if len(warm) >= 6:
        rss0 = statistics.median(s["rss"] for s in warm[:3])
        rss1 = statistics.median(s["rss"] for s in warm[-3:])
        md0 = max(s["metadata"] for s in warm[: max(3, len(warm) // 3)])
        slack = max(args.rss_slack_mib * 2**20, 0.02 * rss0)
        result.update(rss_start=rss0, rss_end=rss1, metadata_start=md0, metadata_end=warm[-1]["metadata"])
        if rss1 - rss0 > slack:
            failures.append(f"RSS grew after warm-up: {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB")
        climb = metadata_climb([s["metadata"] for s in warm])
        if climb:
            failures.append(climb)
        print(f"after warm-up: RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, "
              f"metadata_bytes {md0} -> {warm[-1]['metadata']}; "
              f"{result['ops']} ops ({result['ops'] / (samples[-1]['t'] or 1):.0f}/s)")
    else:
        failures.append(f"only {len(warm)} samples after warm-up; run longer or sample more often")
    result["failures"] = failures
    if args.json:
        write_json(args.json, result)
    for msg in failures:
        print("SOAK FAILED:", msg, file=sys.stderr)
    print("soak:", "FAILED" if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
