"""The `tokens` argument of open_with_prefix, admit and extend: an int64 array
is copied with one memcpy into a buffer each thread reuses (`token_ids.rs`),
any other form is converted as before. Every form must give the same pool,
a shorter call after a longer one must not see the longer one's ids, and a
call made while another call converts its arguments must not share its
buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool import SlotAllocator

PROMPT = [int(x) for x in np.random.default_rng(7).integers(0, 50_000, 96)]


def forms(ids: list[int]):
    """The same ids as every kind of argument the pool reads."""
    a = np.asarray(ids, dtype=np.int64)
    wide = np.repeat(a, 2)
    return {
        "int64": a,
        "int64 strided view": wide[::2],
        "int64 slice at an offset": np.concatenate([[5], a])[1:],
        "int32": a.astype(np.int32),
        "uint16": a.astype(np.uint16) if a.max() < 1 << 16 else a.astype(np.int32),
        "list": list(ids),
        "tensor": torch.tensor(ids, dtype=torch.int64),
    }


def cached_pool(page_size: int) -> SlotAllocator:
    a = SlotAllocator(4096, page_size, 8, 1024)
    (h,), _ = a.open_with_prefix(np.asarray(PROMPT[:64]), [64])
    a.extend(h, 64)
    a.cache(h)
    a.close(h)
    return a


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("form", list(forms(PROMPT)))
def test_open_with_prefix_reads_every_form_alike(page_size, form):
    a = cached_pool(page_size)
    handles, cached = a.open_with_prefix(forms(PROMPT)[form], [len(PROMPT)])
    assert int(cached[0]) == 64
    h = int(handles[0])
    a.extend(h, len(PROMPT) - 64)
    a.cache(h)
    a.close(h)
    # The whole prompt is cached now, under the ids the form carried.
    again, cached = a.open_with_prefix(np.asarray(PROMPT), [len(PROMPT)])
    assert int(cached[0]) == (len(PROMPT) - 1) // page_size * page_size  # one token is left to compute
    a.check()


@pytest.mark.parametrize("form", list(forms(PROMPT[:40])))
def test_admit_and_extend_tokens_read_every_form_alike(form):
    a = SlotAllocator(4096, 1, 8, 1024)
    handles, _ = a.admit([40], tokens=forms(PROMPT[:40])[form])
    a.extend(handles, 3, tokens=forms(PROMPT[40:43])[form])
    a.cache(handles)
    a.close(handles)
    _, cached = a.open_with_prefix(np.asarray(PROMPT[:44]), [44])
    assert int(cached[0]) == 43
    a.check()


def test_a_shorter_call_sees_only_its_own_ids():
    a = cached_pool(1)
    long = np.asarray(PROMPT, dtype=np.int64)
    (h,), cached = a.open_with_prefix(long, [len(PROMPT)])
    a.close(h)
    # The buffer still holds the long prompt: a 10-token prompt that agrees
    # with it only at position 9 must miss from its first token.
    short = np.asarray(PROMPT[:10], dtype=np.int64) + 1
    (h,), cached = a.open_with_prefix(short, [10])
    assert int(cached[0]) == 0
    a.close(h)
    a.check()


def test_bad_ids_are_refused_in_every_form_and_change_nothing():
    a = cached_pool(1)
    before = (a.free_pages, a.cached_pages, a.used_pages)
    bad = list(PROMPT)
    bad[50] = -3
    for form in ("int64", "list", "int32", "tensor"):
        with pytest.raises(kvpool.InvalidArgumentError, match="-3"):
            a.open_with_prefix(forms(bad)[form], [len(bad)])
        assert (a.free_pages, a.cached_pages, a.used_pages) == before
    a.check()


class LengthsThatCallThePool:
    """Lengths whose conversion (numpy.asarray calls __array__) opens another
    request with another prompt: Python code that runs while the outer call
    holds its token buffer."""

    def __init__(self, pool: SlotAllocator, n: int):
        self.pool, self.n = pool, n

    def __array__(self, dtype=None, copy=None):
        pool, self.pool = self.pool, None
        if pool is not None:
            other = np.asarray(PROMPT[::-1], dtype=np.int64)
            (h,), _ = pool.open_with_prefix(other, [len(other)])
            pool.close(h)
        return np.asarray([self.n], dtype=np.int64)


def test_a_call_made_while_another_converts_its_arguments_has_its_own_buffer():
    a = cached_pool(1)
    lengths = LengthsThatCallThePool(a, len(PROMPT))
    tokens = np.asarray(PROMPT, dtype=np.int64)
    (h,), cached = a.open_with_prefix(tokens, lengths)
    assert lengths.pool is None, "the inner call ran"
    # The outer call matched its own prompt's cached 64 tokens, not the
    # reversed prompt the inner call copied.
    assert int(cached[0]) == 64
    a.close(h)
    a.check()
