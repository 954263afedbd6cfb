"""Pools with and without KV events key their prefix index by different chains (the xxh3
chain hash events carry; a cheaper internal chain), which must change a call's cost, never
its result: the same calls give the same handles, hits and slots, and both give and take
the same xxh3 chain hashes for transfers."""

from __future__ import annotations

import numpy as np
import pytest

import kvpool
from kvpool._core import page_hashes


def _pools(page_size: int) -> tuple[kvpool.SlotAllocator, kvpool.SlotAllocator]:
    make = lambda events: kvpool.SlotAllocator(  # noqa: E731
        160, page_size, 8, 256, hash_seed=5, handle_seed=9, kv_events=events)
    return make(True), make(False)


def _drive(a: kvpool.SlotAllocator, rng: np.random.Generator, prompts: list[np.ndarray]) -> list:
    """Random opens of shared prefixes, prefills, caches and closes; every result, in order."""
    out: list = []
    live: list[int] = []
    for _ in range(60):
        op = rng.integers(4)
        if op < 2 or not live:
            p = prompts[rng.integers(len(prompts))]
            cut = int(rng.integers(2, len(p) + 1))
            try:
                h, cached = a.open_with_prefix(p[:cut], np.array([cut]), salt=int(rng.integers(2)))
            except kvpool.KVPoolError as e:
                out.append(type(e).__name__)
                continue
            try:
                slots = a.extend(h, cut - int(cached[0]), tokens=p[int(cached[0]):cut])
            except kvpool.KVPoolError as e:
                out.append(type(e).__name__)
                a.close(h)
                continue
            out.append((int(h[0]), int(cached[0]), slots.tolist()))
            live.append(int(h[0]))
        elif op == 2:
            a.cache(np.array(live[-1:]))
        else:
            h = live.pop(int(rng.integers(len(live))))
            a.close(np.array([h]), cache=bool(rng.integers(2)))
        out.append((a.free_pages, a.cached_pages))
    a.close(np.array(live, dtype=np.int64), cache=True)
    a.check()
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_same_calls_same_results_and_hashes(page_size: int) -> None:
    rng = np.random.default_rng(page_size)
    base = rng.integers(0, 1000, 40)
    prompts = [np.concatenate([base[:k], rng.integers(0, 1000, 12)]) for k in (0, 8, 24, 40)]
    on, off = _pools(page_size)
    got = _drive(on, np.random.default_rng(1), prompts)
    assert got == _drive(off, np.random.default_rng(1), prompts)
    assert sum(1 for r in got if isinstance(r, tuple) and len(r) == 3 and r[1] > 0) >= 5, "the trace hits"

    # Both give the xxh3 chain hashes (page_hashes) for a request, and take each other's.
    p = prompts[-1]
    for src, dst in ((on, off), (off, on)):
        h, c = src.open_with_prefix(p, np.array([len(p)]), salt=3)
        src.extend(h, len(p) - int(c[0]), tokens=p[int(c[0]):])
        src.cache(h)
        hashes, tokens, salt = src.chain_hashes(int(h[0]))
        n = len(p) // page_size
        want = page_hashes(p[: n * page_size], page_size, 5, salt=3)
        assert np.array_equal(hashes, want)
        hd, c = dst.open_with_prefix(p, np.array([len(p)]), salt=3)
        dst.extend(hd, len(p) - int(c[0]), tokens=p[int(c[0]):])
        dst.cache(hd)
        assert dst.match_chain_hashes(hashes, tokens, salt) == n
        forged = hashes.copy()
        forged[2 * 2 + 1] ^= np.uint64(1)  # page 2's low word
        assert dst.match_chain_hashes(forged, tokens, salt) == 2
        dst.close(hd)
        src.close(h)
    on.check()
    off.check()
