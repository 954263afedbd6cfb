"""A hybrid pool converts a call's handles once, before the core commits: it reads them again
afterwards (``_note_edit``, copies, window rows), and an argument whose own conversion code
(``__index__``) answers once and then raises left the requests closed, truncated or forked
behind an untyped error, where docs/errors.md promises a refusal that changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _once_index import OnceIndex

from kvpool import KVPool
from kvpool._core import InvalidArgumentError

TYPES = ["sliding_attention", "full_attention", "linear_attention"]


def make():
    return KVPool(3, 2, 8, layer_types=TYPES, sliding_window=8, state_shapes={"rec": (2, 3)},
                  dtype=torch.float32, page_size=4, num_pages=64, max_requests=8, max_context_len=64)


CALLS = {
    "close": lambda p, h, c: p.close([c(h)]),
    "close(cache=True)": lambda p, h, c: p.close([c(h)], cache=True),
    "truncate": lambda p, h, c: p.truncate([c(h)], [8]),
    "extend": lambda p, h, c: p.extend([c(h)], [3]),
    "fork": lambda p, h, c: p.fork(c(h), 2),
}


def scene(pool):
    h, _ = pool.admit([8], tokens=np.arange(1, 9))
    pool.cache(h)  # (a state checkpoint at 8, for the truncate)
    pool.extend(h, [2], tokens=[9, 10])
    return int(h[0])


def state(pool, h):
    open_ = pool.allocator.is_open(h)
    rows = [pool.allocator.slots(h, g.index).tolist() for g in pool.groups if g.kind != "state"] if open_ else []
    return (open_, pool.allocator.length(h) if open_ else None, rows, pool.allocator.stats())


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_handle_s_own_conversion_code_runs_once(call):
    run = CALLS[call]
    plain = make()
    hp = scene(plain)
    run(plain, hp, int)
    for exc in (ValueError("flaky"), KeyboardInterrupt()):
        other = make()
        h = scene(other)
        run(other, h, lambda x, exc=exc: OnceIndex(x, 1, exc))  # does what the int does
        assert state(other, h) == state(plain, hp)
        other.allocator.check()
    for exc, err in ((ValueError("flaky"), InvalidArgumentError), (KeyboardInterrupt(), KeyboardInterrupt)):
        other = make()
        h = scene(other)
        before = state(other, h)
        with pytest.raises(err):
            run(other, h, lambda x, exc=exc: OnceIndex(x, 0, exc))
        assert state(other, h) == before
        other.allocator.check()
