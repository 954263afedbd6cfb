"""Attention over K/V read through the pool's request-to-token table.

The pool stores K/V per slot; ``pool.req_to_token[row, i]`` is the slot of token i
of the request in that row. Gathering ``k_buffer[req_to_token[rows, :width]]`` gives
each request's keys in token order, padded to ``width``; columns past a request's
length hold whatever the table has there (zeros for the null row and unwritten
columns, i.e. the reserved slot 0), and the mask hides them.

Everything here is plain tensor indexing with shapes fixed by (B, T, width), so the
same code runs eagerly and inside a captured CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """[..., Tq, Tk] bool: query at position p sees keys at positions <= p."""
    return k_positions.unsqueeze(-2) <= q_positions.unsqueeze(-1)


def pool_mask(positions: torch.Tensor, width: int) -> torch.Tensor:
    """[B, T, width] bool for queries at ``positions`` [B, T] over gathered columns.

    Column j of the gather holds the request's token j, so a query at position p sees
    columns 0..p: its own token (just written) and everything before it. Column 0 is
    always visible, so even padded rows (position 0, null row) never softmax over
    nothing and stay finite.
    """
    cols = torch.arange(width, device=positions.device)
    return causal_mask(positions, cols)


def _slots_view(buf: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    # Token layout is already [num_slots, H, D]; the paged layout [num_pages, P, H, D]
    # is contiguous, so slot = page*P + offset makes this a view, not a copy.
    return buf.view(-1, num_kv_heads, head_dim)


def gather_kv(pool: Any, layer: int, slot_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, width, H_kv, D] of each request, in token order."""
    k = _slots_view(pool.k_buffer(layer), pool.num_kv_heads, pool.head_dim)
    v = _slots_view(pool.v_buffer(layer), pool.num_kv_heads, pool.head_dim)
    return k[slot_idx], v[slot_idx]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention.

    q [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; mask [B, Tq, Tk] bool (True = may attend).
    Returns [B, Tq, Hq, D]. Query head h reads KV head h // (Hq/Hkv), the usual GQA
    grouping, done by reshaping rather than copying K/V per query head.
    """
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    qg = q.float().view(b, tq, hkv, group, d).permute(0, 2, 3, 1, 4)   # [B, Hkv, G, Tq, D]
    kt = k.float().permute(0, 2, 3, 1)                                 # [B, Hkv, D, Tk]
    vt = v.float().permute(0, 2, 1, 3)                                 # [B, Hkv, Tk, D]
    scores = (qg @ kt.unsqueeze(2)) * (d ** -0.5)                       # [B, Hkv, G, Tq, Tk]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    out = scores.softmax(-1) @ vt.unsqueeze(2)                          # [B, Hkv, G, Tq, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, tq, hq, d).to(q.dtype)


# Float32 score elements one block of queries may take. A long prompt's prefill would
# otherwise build [B, Hq, T, T] scores and a [B, T, T] mask at once: 115 GB at 60K tokens.
MAX_SCORE_ELEMENTS = 1 << 25


def _block(b: int, heads: int, tk: int) -> int:
    return max(1, MAX_SCORE_ELEMENTS // max(1, b * heads * tk))


def step_mask(positions: torch.Tensor, heads: int, width: int) -> torch.Tensor | None:
    """``pool_mask(positions, width)`` when the step's queries take one block of
    ``attend_causal`` (built once, shared by every layer), else None (each block builds its own:
    the whole mask of a long prefill is as large as its scores)."""
    b, tq = positions.shape
    return pool_mask(positions, width) if _block(b, heads, width) >= tq else None


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """``attend`` with ``pool_mask(positions, Tk)`` (or ``mask``, ``step_mask``'s), over blocks of
    queries whose scores stay under ``MAX_SCORE_ELEMENTS``: a decode step, or any short prefill,
    is one block, the same ops as one ``attend``. Shapes fixed by (B, T, Tk), so a captured
    graph may run it."""
    b, tq, hq, _ = q.shape
    tk = k.shape[1]
    block = _block(b, hq, tk)
    if block >= tq:
        return attend(q, k, v, pool_mask(positions, tk) if mask is None else mask)
    return torch.cat([attend(q[:, s:s + block], k, v, pool_mask(positions[:, s:s + block], tk))
                      for s in range(0, tq, block)], 1)
