"""Shared pieces of the outside-style host-tier checks (test_outside_host_tier_*.py).

K/V values here depend on a request's whole prefix (tokens and salt up to and including
the position), the way real K/V does: a host hit that loads a page with the same tokens
under another parent, or another salt's page, reads different bytes and is caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool

H, D, LAYERS = 1, 2, 2


def prefix_values(tokens, salt, layer):
    """K and V rows [len(tokens), H, D] (float32, exact): position i's row is a rolling hash
    of (salt, tokens[0..i]) and the layer, kept below 2**22 so float32 holds it exactly."""
    out = np.empty(len(tokens), dtype=np.int64)
    acc = (salt * 1_000_003 + 17) % 4_194_301
    for i, t in enumerate(tokens):
        acc = (acc * 31 + int(t) + 1) % 4_194_301
        out[i] = acc
    base = torch.from_numpy(out).to(torch.float32).view(-1, 1, 1) + layer
    k = base.expand(-1, H, D).clone() + torch.arange(D, dtype=torch.float32)
    return k, -k - 1


def write_positions(pool, slots, tokens, salt, start):
    """Write positions start.. of a request holding ``tokens`` into ``slots``."""
    idx = torch.as_tensor(np.asarray(slots, dtype=np.int64))
    for layer in range(LAYERS):
        k, v = prefix_values(tokens, salt, layer)
        pool.write(layer, idx, k[start:], v[start:])


def assert_holds(pool, h, tokens, salt, upto=None):
    """The request's first ``upto`` positions read back bitwise through ``pool.read`` and
    its ``req_to_token`` row names its slots."""
    upto = len(tokens) if upto is None else upto
    slots = pool.slots(h)
    assert len(slots) == pool.length(h) == len(tokens)
    row = int(pool.rows([h])[0])
    assert pool.req_to_token[row, : len(slots)].tolist() == slots.tolist()
    idx = torch.as_tensor(slots[:upto])
    for layer in range(LAYERS):
        k, v = prefix_values(tokens[:upto], salt, layer)
        rk, rv = pool.read(layer, idx)
        bad = (rk != k).flatten(1).any(1) | (rv != v).flatten(1).any(1)
        assert not bool(bad.any()), (
            f"request {h} layer {layer}: positions {torch.nonzero(bad).flatten().tolist()} of {upto} "
            f"read other bytes than were written")


def state(pool, handles):
    """Everything a refused call must leave as it was, read without changing anything:
    counters (host tier's included), priorities, queues, each request's place, length,
    known tokens, row and slots, and the bytes of every tensor the pool owns (the host
    storage and req_to_token included)."""
    s = pool.stats()
    counters = [(f, getattr(s, f)) for f in dir(s) if not f.startswith("_") and not callable(getattr(s, f))]
    a = pool.allocator
    per = []
    for h in handles:
        if not pool.is_open(h):
            per.append(None)
            continue
        swapped = pool.is_swapped(h)
        per.append((swapped, pool.length(h), pool.known_tokens(h).tolist(), pool.rows([h]).tolist(),
                    None if swapped else pool.slots(h).tolist()))
    tensors = [(n, bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())) for n, t in pool.named_tensors()]
    return (counters, pool.evictable_pages_by_priority().tolist(), pool.pinned_pages,
            (a.pending_offloads, a.pending_loads, a.pending_copies), per, tensors)


def no_events(events):
    return all(len(v) == 0 for v in events.values())


def assert_refused_cleanly(pool, handles, call, err):
    """``call`` raises ``err`` (a kvpool error) and changes nothing: ``state`` is equal
    and no KV event was emitted; ``check()`` still passes."""
    assert issubclass(err, kvpool.KVPoolError)
    pool.take_events()
    before = state(pool, handles)
    with pytest.raises(err) as info:
        call()
    assert str(info.value), "a refusal says what was wrong"
    assert state(pool, handles) == before
    assert no_events(pool.take_events())
    pool.check()
    return info.value
