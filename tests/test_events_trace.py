"""The KV event stream describes exactly what a pool caches: a random trace
(shared prefixes, salts, decode steps, evictions, clear_cache, a host tier with
swaps), each step's batch decoded with vLLM's own classes, and the pool's
registered pages rebuilt from the events alone and compared with the pool's
view after every step (counts per tier, hashes recomputed from the events'
tokens, and the device hit each prompt gets)."""

import numpy as np
import pytest

import kvpool
from kvpool import _core

pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed")
import msgspec  # noqa: E402

from kvpool.events import LocalEventPublisher  # noqa: E402

SEED = 77


class Mirror:
    """A consumer that knows the pool only through its events."""

    def __init__(self, page_size):
        self.P = page_size
        self.held = {"GPU": set(), "CPU": set()}
        self.chain = {}  # hash -> (parent hash or None, tokens, salt)
        self.dec = msgspec.msgpack.Decoder(kv_events.KVEventBatch)

    def apply(self, payload, rank):
        batch = self.dec.decode(payload)
        assert batch.data_parallel_rank == rank
        for ev in batch.events:
            if isinstance(ev, kv_events.AllBlocksCleared):
                for s in self.held.values():
                    s.clear()
                continue
            held = self.held[ev.medium]
            if isinstance(ev, kv_events.BlockRemoved):
                for h in ev.block_hashes:
                    assert h in held, "Removed names a page the stream never stored (or removed twice)"
                    held.discard(h)
                continue
            assert isinstance(ev, kv_events.BlockStored)
            assert ev.block_size == self.P and len(ev.token_ids) == self.P * len(ev.block_hashes)
            assert ev.lora_id is None and ev.lora_name is None
            key = ev.extra_keys[0][0] if ev.extra_keys else "0"
            assert ev.extra_keys is None or ev.extra_keys == [(key,)] * len(ev.block_hashes)
            salt = int(key)
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                assert isinstance(h, bytes) and len(h) == 16
                assert h not in held, "Stored twice in one tier without a Removed between"
                toks = ev.token_ids[i * self.P:(i + 1) * self.P]
                self.chain[h] = (parent, toks, salt)
                assert self.rehash(h) == h, "the hash is the chain hash of the event's tokens"
                held.add(h)
                parent = h

    def tokens_of(self, h):
        toks, salt = [], None
        while h is not None:
            parent, t, salt = self.chain[h]
            toks[:0] = t
            h = parent
        return toks, salt

    def rehash(self, h):
        toks, salt = self.tokens_of(h)
        w = _core.page_hashes(np.array(toks, dtype=np.int64), self.P, SEED, salt)
        return ((int(w[-2]) << 64) | int(w[-1])).to_bytes(16, "big")

    def device_hit(self, prompt, salt):
        w = _core.page_hashes(prompt, self.P, SEED, salt)
        n = 0
        for i in range(len(w) // 2):
            if ((int(w[2 * i]) << 64) | int(w[2 * i + 1])).to_bytes(16, "big") not in self.held["GPU"]:
                break
            n += 1
        return n, w


@pytest.mark.parametrize("page_size,host_pages", [(1, 0), (16, 0), (1, 40), (16, 24)])
def test_events_rebuild_the_pools_cached_pages_after_every_step(page_size, host_pages):
    P = page_size
    pages = 48 if P == 16 else 300
    a = kvpool.SlotAllocator(pages, P, 16, 64 * P, hash_seed=SEED, host_pages=host_pages)
    pub = LocalEventPublisher(a, data_parallel_rank=3)
    mirror = Mirror(P)
    rng = np.random.default_rng(P * 1000 + host_pages)
    stems = [rng.integers(0, 40, size=int(rng.integers(P, 6 * P))) for _ in range(5)]
    open_, swapped, kinds = [], set(), set()
    for step in range(400):
        r = rng.random()
        try:
            if r < 0.45:
                prompt = np.concatenate([stems[int(rng.integers(0, 5))], rng.integers(0, 40, size=int(rng.integers(1, 2 * P)))])
                salt = int(rng.integers(0, 3))
                h, c = a.open_with_prefix(prompt, [len(prompt)], salt=salt)
                a.extend(h, len(prompt) - int(c[0]))
                a.cache(h)
                open_.append(int(h[0]))
            elif r < 0.6 and open_:
                h = open_[int(rng.integers(0, len(open_)))]
                if h not in swapped:
                    a.extend(np.array([h]), int(rng.integers(1, 2 * P)))
                    a.cache(np.array([h]))
            elif r < 0.8 and open_:
                h = open_.pop(int(rng.integers(0, len(open_))))
                if h in swapped:
                    a.swap_in(np.array([h]))
                    swapped.discard(h)
                a.close(np.array([h]), cache=bool(rng.random() < 0.5))
            elif r < 0.9:
                a.evict(int(rng.integers(1, 6)))
            elif r < 0.97 and host_pages and open_:
                h = open_[int(rng.integers(0, len(open_)))]
                if h in swapped:
                    a.swap_in(np.array([h]))
                    swapped.discard(h)
                else:
                    a.swap_out(np.array([h]))
                    swapped.add(h)
            elif r >= 0.995:
                a.clear_cache()
        except (kvpool.PoolExhaustedError, kvpool.ContextTooLongError, kvpool.TooManyRequestsError):
            pass
        a.take_offloads()
        a.take_loads()
        a.take_copies()
        if pub.publish():
            (_, _, payload), = pub.drain()
            mirror.apply(payload, 3)
            kinds.update(type(e).__name__ + ":" + str(getattr(e, "medium", "")) for e in
                         msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload).events)
        assert len(mirror.held["GPU"]) == a.cached_pages, step
        assert len(mirror.held["CPU"]) == a.host_cached_pages, step
        probe = np.concatenate([stems[step % 5], [1, 2, 3]])
        for salt in range(3):
            n, w = mirror.device_hit(probe, salt)
            assert a.match_chain_hashes(w, probe[: len(w) // 2 * P], salt) == n, (step, salt)
    a.check()
    assert {"BlockStored:GPU", "BlockRemoved:GPU"} <= kinds
    if host_pages:
        assert {"BlockStored:CPU", "BlockRemoved:CPU"} <= kinds, kinds
