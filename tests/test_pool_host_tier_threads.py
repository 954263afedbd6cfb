"""One KVPool with a host tier shared by threads: prefixes are served, published,
evicted to the host and hit again, and requests swapped out and in, from several
threads at once, also beside a DiskCache helper thread. The pool's lock covers each
call's transfers, so every hit and every swapped-in request reads exactly the K/V its
tokens were written with."""

from __future__ import annotations

import threading

import numpy as np
import torch

import kvpool

H, D, LAYERS, PS = 2, 4, 2, 4
SEQS = 6  # token sequences; a prompt is a prefix of one, so equal tokens mean equal K/V
LEN = 24
MAX_ROUNDS = 400  # a serving thread's bound while it waits for the disk helper's loads


def kv(tokens, layer):
    t = torch.tensor(tokens, dtype=torch.float32)
    return ((t % 251) + layer * 0.5).view(-1, 1, 1).expand(-1, H, D).clone()


def check_kv(pool, h, tokens, upto):
    """Request ``h``'s first ``upto`` positions hold the K/V of ``tokens`` (V = -K)."""
    slots = pool.slots(h)[:upto]
    for layer in range(LAYERS):
        k, v = pool.read(layer, slots)
        want = kv(tokens[:upto], layer)
        assert torch.equal(k, want) and torch.equal(v, -want), "wrong K/V"


def test_threads_share_a_tiered_pool():
    pool = kvpool.KVPool(LAYERS, H, D, dtype=torch.float32, page_size=PS, num_pages=24, max_requests=16,
                         max_context_len=64, host_pages=64, hash_seed=1)
    seqs = [list(range(1000 * (s + 1), 1000 * (s + 1) + LEN)) for s in range(SEQS)]
    errors: list[BaseException] = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                tokens = seqs[int(rng.integers(SEQS))][: int(rng.integers(PS + 1, LEN + 1))]
                try:
                    h, cached = pool.open_with_prefix(tokens, [len(tokens)])
                except (kvpool.TooManyRequestsError, kvpool.PoolExhaustedError):
                    continue
                h, c = int(h[0]), int(cached[0])
                try:
                    check_kv(pool, h, tokens, c)
                    r = pool.extend([h], len(tokens) - c)
                    for layer in range(LAYERS):
                        k = kv(tokens, layer)[c:]
                        pool.write(layer, torch.as_tensor(r.slots), k, -k)
                    if rng.random() < 0.5:
                        pool.swap_out([h])
                        pool.swap_in([h])
                    check_kv(pool, h, tokens, len(tokens))
                except kvpool.PoolExhaustedError:
                    pass
                pool.close([h], cache=not pool.is_swapped(h))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    pool.check()
    a = pool.allocator
    assert a.offloaded_pages > 0 and a.loaded_pages > 0 and pool.host_hit_tokens > 0
    assert (a.pending_offloads, a.pending_loads) == (0, 0)


def test_a_disk_cache_thread_beside_serving_threads(tmp_path):
    """docs/tiers.md: store_new and prefetch may run from a helper thread while other
    threads serve, swap and evict on the same tiered pool. Every hit and swap-in reads
    its tokens' K/V, and a fresh pool prefetching from the same directory too."""
    from kvpool.tiers import DiskCache, FileTier

    def pool_of(seed, host_pages):
        return kvpool.KVPool(LAYERS, H, D, dtype=torch.float32, page_size=PS, num_pages=20, max_requests=12,
                             max_context_len=64, host_pages=host_pages, hash_seed=seed)

    seqs = [list(range(1000 * (s + 1), 1000 * (s + 1) + LEN)) for s in range(SEQS)]
    errors: list[BaseException] = []
    for policy in ("write_back", "write_through"):
        pool = pool_of(1, 16)
        tier = FileTier(tmp_path / policy, 1 << 20)
        disk = DiskCache(pool, tier, model="m")
        stop = threading.Event()

        def serve(seed):
            rng = np.random.default_rng(seed)
            try:
                for i in range(MAX_ROUNDS):
                    # 30 rounds each, then on until the helper's prefetches have loaded pages
                    # and a hit has read pages from the host tier: when the helper gets its
                    # turns is the scheduler's business (on a loaded machine it may get none
                    # in the first 30 rounds), not the pool's.
                    if i >= 30 and disk.stats.pages_loaded > 0 and pool.host_hit_tokens > 0:
                        break
                    tokens = seqs[int(rng.integers(SEQS))][: int(rng.integers(PS + 1, LEN + 1))]
                    try:
                        h, cached = pool.open_with_prefix(tokens, [len(tokens)])
                    except (kvpool.TooManyRequestsError, kvpool.PoolExhaustedError):
                        continue
                    h, c = int(h[0]), int(cached[0])
                    try:
                        check_kv(pool, h, tokens, c)
                        r = pool.extend([h], len(tokens) - c)
                        for layer in range(LAYERS):
                            k = kv(tokens, layer)[c:]
                            pool.write(layer, torch.as_tensor(r.slots), k, -k)
                        if rng.random() < 0.5:
                            pool.swap_out([h])
                            pool.evict(int(rng.integers(0, 4)))
                            pool.swap_in([h])
                        check_kv(pool, h, tokens, len(tokens))
                    except kvpool.PoolExhaustedError:
                        pass
                    pool.close([h], cache=not pool.is_swapped(h))
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        def store_and_prefetch():
            rng = np.random.default_rng(99)
            try:
                while not stop.is_set():
                    disk.store_new()
                    disk.prefetch(seqs[int(rng.integers(SEQS))])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        helper = threading.Thread(target=store_and_prefetch)
        servers = [threading.Thread(target=serve, args=(i,)) for i in range(3)]
        helper.start()
        for t in servers:
            t.start()
        for t in servers:
            t.join()
        stop.set()
        helper.join()
        assert not errors, errors[0]
        pool.check()
        disk.store_new()
        assert disk.stats.pages_stored > 0 and disk.stats.pages_loaded > 0 and pool.host_hit_tokens > 0
        fresh = pool_of(2, 0)
        again = DiskCache(fresh, tier, model="m")
        hits = 0
        for s in seqs:
            again.prefetch(s)
            h, cached = fresh.open_with_prefix(s, [len(s)])
            hits += int(cached[0])
            check_kv(fresh, int(h[0]), s, int(cached[0]))
            fresh.close(h)
        assert hits > 0
