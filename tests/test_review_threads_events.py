"""Outside-style sweep (threads): the KV event stream drained while threads serve a plain pool.

Worker threads serve prompts on shared prefixes (prefill, decode steps, ``cache``, and with a host
tier ``swap_out`` / ``swap_in``), reading every position back bitwise, while another thread evicts,
clears the cache, drains the events (``take_events``, or a ``LocalEventPublisher``'s messages),
reads ``stats()`` and runs ``check()``. Replayed in order, every Removed page was Stored before, no
page is Stored twice, and what is left registered per medium equals ``cached_pages`` /
``host_cached_pages``; every ``stats()`` taken meanwhile adds up (one snapshot under one lock,
docs/allocator.md). Helpers are ``test_review_threads_sweep.py``'s.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from test_review_threads_sweep import REFUSED, Registry, run_threads, value

from kvpool import KVPool, PoolExhaustedError

# ----- the event stream and stats() of a plain pool shared by threads ----------------------


def serve(pool: KVPool, seed: int, bases: list, rounds: int, host: bool, after=None) -> None:
    """One worker: prompts on shared prefixes, prefill, decode steps (cached now and then,
    swapped out and in with a host tier), close (cached or not), then ``after()`` (a publish, as
    an engine's step loop); reads every position back."""
    rng = random.Random(seed)

    def check(h: int, salt: int, toks: list, what: str) -> None:
        slots = pool.slots(h)
        assert pool.req_to_token[int(pool.rows([h])[0]), : len(toks)].tolist() == slots.tolist(), (seed, what)
        k, v = pool.read(0, torch.as_tensor(slots))
        want = torch.tensor([value(salt, toks[: i + 1], 0) for i in range(len(toks))])
        assert torch.equal(k.view(-1), want) and torch.equal(v.view(-1), want), (seed, what)

    def store(res, salt: int, toks: list, start: int) -> None:
        x = torch.tensor([value(salt, toks[: i + 1], 0) for i in range(start, len(toks))]).view(-1, 1, 1)
        pool.write(0, res.out_cache_loc, x, x)

    for _ in range(rounds):
        salt, n = rng.choice([0, 0, 7]), rng.randint(1, 30)
        prompt = rng.choice(bases)[:n] if rng.random() < 0.8 else [rng.randint(1, 3) for _ in range(n)]
        try:
            hs, cached = pool.open_with_prefix(np.array(prompt), [n], salt=salt or None)
        except REFUSED:
            continue
        h, c, toks = int(hs[0]), int(cached[0]), list(prompt)
        try:
            store(pool.extend([h], [n - c], tokens=np.array(prompt[c:])), salt, toks, c)
            check(h, salt, toks, "prefill")
            for _ in range(rng.randint(0, 6)):
                toks.append(rng.randint(1, 3))
                store(pool.extend([h], [1], tokens=np.array(toks[-1:])), salt, toks, len(toks) - 1)
                if rng.random() < 0.3:
                    pool.cache([h])
                if host and rng.random() < 0.2:
                    pool.swap_out([h])
                    pool.swap_in([h])
            check(h, salt, toks, "decode")
        except PoolExhaustedError:
            if pool.is_swapped(h):
                try:
                    pool.swap_in([h])
                except PoolExhaustedError:
                    pass
        pool.close([h], cache=not pool.is_swapped(h) and rng.random() < 0.7)
        if after is not None:
            after()


@pytest.mark.parametrize("drain", ["take_events", "publisher"])
@pytest.mark.parametrize("host", [False, True], ids=["no_tier", "host_tier"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_events_drained_while_threads_serve_replay_to_the_registered_pages(page_size, host, drain):
    seed = 50 + page_size + 2 * host
    pool = KVPool(1, 1, 1, dtype=torch.float32, page_size=page_size, num_pages=28, max_requests=12,
                  max_context_len=64, hash_seed=seed, **(dict(host_pages=12) if host else {}))
    rng = random.Random(seed)
    bases = [[rng.randint(1, 3) for _ in range(40)] for _ in range(3)]
    registry, messages, lock = Registry(), [], threading.Lock()
    publisher = None
    if drain == "publisher":
        pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
        from kvpool.events import LocalEventPublisher
        publisher = LocalEventPublisher(pool)

    def take() -> None:
        if publisher is not None:
            publisher.publish()
            messages.extend(publisher.drain())
        else:
            ev = pool.take_events()
            with lock:
                registry.apply(ev)

    def churn(stop: threading.Event) -> None:
        r = random.Random(seed * 7)
        while not stop.is_set():
            x = r.random()
            if x < 0.3:
                pool.evict(r.randint(1, 6))
            elif x < 0.33:
                pool.clear_cache()
            elif x < 0.6:
                take()
            elif x < 0.85:
                s = pool.stats()  # one snapshot: its counters agree with each other
                assert s.free_pages + s.used_pages == pool.capacity_pages, s
                assert s.free_slots == s.free_pages * page_size == s.admissible_tokens, s
                assert sum(s.evictable_pages_by_priority) == s.evictable_pages <= s.cached_pages, s
                assert host or s.host_free_pages == 0, s
            else:
                pool.check()

    # With a publisher, the workers publish too, as engines' step loops would (the numbering of
    # batches drained at once is forced deterministically in test_events_publish_threads.py).
    after = take if publisher is not None else None
    run_threads([lambda w=w: serve(pool, seed * 100 + w, bases, 60, host, after) for w in range(3)], churn)
    pool.check()
    take()
    s = pool.stats()
    assert s.open_requests == 0 and s.used_pages == 0, s
    if publisher is not None:
        registry = wire_registry(messages)
        publisher.close()
    assert not registry.problems, registry.problems[:3]
    assert registry.count(0) == s.cached_pages, (registry.count(0), s)
    if host:
        assert registry.count(1) == s.host_cached_pages, (registry.count(1), s)


def wire_registry(messages: list) -> Registry:
    """The publisher's messages in sequence order (no gap), replayed as a Registry."""
    from kvpool.events.schema import AllBlocksCleared, BlockStored, decoder

    dec, registry = decoder(), Registry()
    media = {"GPU": 0, "CPU": 1, "STORAGE": 2, None: 0}
    seqs = sorted(int.from_bytes(m[1], "big") for m in messages)
    assert seqs == list(range(len(seqs))), seqs[:10]
    for _, _, payload in sorted(messages, key=lambda m: m[1]):
        for e in dec.decode(payload).events:
            kind = 2 if isinstance(e, AllBlocksCleared) else 0 if isinstance(e, BlockStored) else 1
            hashes = [b"" if kind == 2 else h for h in getattr(e, "block_hashes", [b""])]
            registry.apply({"kind": np.array([kind] * len(hashes)),
                            "hash_hi": np.array([int.from_bytes(h[:8] or b"\0", "big") for h in hashes], dtype=np.uint64),
                            "hash_lo": np.array([int.from_bytes(h[8:] or b"\0", "big") for h in hashes], dtype=np.uint64),
                            "medium": np.array([media[getattr(e, "medium", None)]] * len(hashes))})
    return registry
