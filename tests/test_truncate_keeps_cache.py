"""A request truncated into a registered page (an edited turn, rejected draft tokens)
and written on: the page's cached continuation must keep hitting, with the K/V it was
computed with, while the request reads its own new tokens. The core copies such a page
instead of unregistering it (the anchor chain where cached pages continue it, every
other group's registered page always); written in place, the old chain's hit stopped
at the page and everything after it was recomputed."""

import numpy as np
import pytest
import torch

import kvpool

PROMPT = np.arange(100, 125, dtype=np.int64)  # 25 tokens: 24 can hit
CUT, NEW = 13, np.array([1, 2, 3], dtype=np.int64)

CONFIGS = {
    "plain": dict(page_size=4),
    "hybrid": dict(page_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=16),
    "hybrid-nested": dict(page_size={"full_attention": 4, "sliding_attention": 2},
                          layer_types=["sliding_attention", "full_attention"], sliding_window=16),
    "hybrid-token-anchor": dict(page_size={"full_attention": 4, "sliding_attention": 3},
                                layer_types=["sliding_attention", "full_attention"], sliding_window=16),
}


def _pool(cfg):
    return kvpool.KVPool(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu",
                         num_pages=64, max_requests=4, max_context_len=64, **CONFIGS[cfg])


def _slots(pool, h, layer):
    if hasattr(pool, "layer_types"):
        return np.asarray(pool.slots(int(h[0]), layer))
    return np.asarray(pool.slots(int(h[0])))


def _value(pos, tok, layer):
    return float(tok * 1000 + pos * 10 + layer)


def _write(pool, h, start, toks):
    """K/V of positions start.. of request h: a value naming (position, token, layer)."""
    for layer in range(pool.num_layers):
        slots = _slots(pool, h, layer)[start:start + len(toks)]
        vals = torch.tensor([_value(start + i, int(t), layer) for i, t in enumerate(toks)])
        kv = vals.view(-1, 1, 1).expand(-1, 1, 2).contiguous()
        keep = slots >= 0  # a sliding group's released positions are padding
        pool.write(layer, slots[keep], kv[torch.from_numpy(keep)], -kv[torch.from_numpy(keep)])


def _check(pool, h, toks):
    """Every position request h holds reads the K/V written for its tokens (a sliding
    layer: the positions it still attends to; before its window a hit names the null
    page 0, which reads zeros)."""
    for layer in range(pool.num_layers):
        slots = _slots(pool, h, layer)[:len(toks)]
        sliding = getattr(pool, "layer_types", [None] * pool.num_layers)[layer] == "sliding_attention"
        floor = pool.page_size_of(layer) if sliding else 0
        held = np.flatnonzero(slots >= floor)
        if sliding:
            assert held.size and held[-1] == len(toks) - 1, "the window's last position is held"
        k, v = pool.read(layer, slots[held])
        want = torch.tensor([_value(int(i), int(toks[i]), layer) for i in held])
        assert torch.equal(k[:, 0, 0], want), f"layer {layer}: positions {held.tolist()}"
        assert torch.equal(v[:, 0, 0], -want)


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_the_old_chain_keeps_hitting_with_its_own_kv(cfg):
    pool = _pool(cfg)
    n = len(PROMPT)
    h, c = pool.open_with_prefix(PROMPT, [n])
    pool.extend(h, n)
    _write(pool, h, 0, PROMPT)
    pool.close(h, cache=True)

    h, c = pool.open_with_prefix(PROMPT, [n])
    assert int(c[0]) == n - 1
    pool.truncate(h, CUT)
    pool.extend(h, len(NEW), tokens=NEW)
    _write(pool, h, CUT, NEW)
    edited = np.concatenate([PROMPT[:CUT], NEW])
    _check(pool, h, edited)
    pool.check()

    # The old prompt hits all of it, while the edited request is open and after it closed,
    # and reads the K/V its own tokens were written with.
    for close_edited in (False, True):
        if close_edited:
            pool.close(h, cache=True)
        r, c = pool.open_with_prefix(PROMPT, [n])
        assert int(c[0]) == n - 1, f"hit {int(c[0])} (edited request closed: {close_edited})"
        _check(pool, r, PROMPT[:n - 1])
        pool.close(r)
        pool.check()
    # The edited prompt hits its own pages (whole pages of every group).
    r, c = pool.open_with_prefix(np.concatenate([edited, [9]]), [len(edited) + 1])
    assert int(c[0]) >= 12
    _check(pool, r, edited[:int(c[0])])
    pool.close(r)
    pool.check()
