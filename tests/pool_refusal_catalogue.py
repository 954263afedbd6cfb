"""Bad calls for tests/test_refusals_pool_stateful.py: the torch pool ``KVPool``.

Two lists of (name, make): ``make(pool, ctx)`` returns a thunk that makes one call
on ``pool`` which must be refused with a kvpool error, or None when the state it
needs is missing. ``ALLOCATOR_LEVEL`` is tests/refusal_catalogue.py's entries for
the calls KVPool forwards to its allocator (those naming an allocator-only keyword
or method left out); ``TORCH_LEVEL`` is the torch layer's own: layers, K/V rows,
slots, reads, the kernels on the pool's caches, page tables.

``ODD`` lists legitimate but unusual forms of a write's rows (non-contiguous,
overlapping, requiring grad, an inference tensor): the pool must either refuse
them with a kvpool error and change nothing, or store exactly what the plain
contiguous rows store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from _once_index import OnceIndex
from refusal_catalogue import COMMON, LATE, SLOT_LATE, SLOT_ONLY, Ctx

from kvpool.kernels import copy_slots, gather_kv, store_kv


@dataclass
class PoolCtx(Ctx):
    num_layers: int = 2
    num_slots: int = 0
    heads: int = 2
    dim: int = 4
    dtype: torch.dtype = torch.float32  # the rows a write takes (compute_dtype)
    foreign_loc: Any = None  # an ExtendResult.out_cache_loc of another, larger pool, past this one
    own: Any = field(default=None, repr=False)  # a recent ExtendResult of this pool (may be stale)
    room: int = 0  # slots the tightest page group can still hand out (free, or cached and evictable)
    hybrid: bool = False  # a HybridKVPool: per-layer slots and page tables (layer 0: full attention)


def _q(c: PoolCtx) -> tuple[int, ...]:
    """The layer argument a hybrid pool's per-layer queries take (slots, page_table)."""
    return (0,) if c.hybrid else ()


def _kw_free(name: str) -> bool:
    """An allocator catalogue entry that KVPool's call takes as it is."""
    method = name.split("(", 1)[0].strip()
    from kvpool import KVPool

    return (hasattr(KVPool, method) and not any(k in name for k in ("out=", "table=", "tables=", "out ")))


ALLOCATOR_LEVEL = [(n, m) for n, m in COMMON + SLOT_ONLY + LATE + SLOT_LATE if _kw_free(n)]


def rows(c: PoolCtx, n: int, *, heads: int | None = None, dim: int | None = None, dtype: Any = None,
         device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(n * (heads or c.heads) * (dim or c.dim), dtype=torch.float32).reshape(
        n, heads or c.heads, dim or c.dim) % 13 - 6
    return k.to(dtype or c.dtype).to(device), (-k).to(dtype or c.dtype).to(device)


def _live_slots(f: Callable[[Any, PoolCtx, np.ndarray], Any]) -> Callable[[Any, PoolCtx], Any]:
    """Calls that need a live request with at least one slot: gets its slots."""

    def call(p: Any, c: PoolCtx) -> Any:
        for h in ([c.pick(c.live)] if c.live else []) + c.live:
            s = p.slots(h, *_q(c))
            if len(s):
                return lambda: f(p, c, s)
        return None

    return call


def _always(f: Callable[[Any, PoolCtx], Any]) -> Callable[[Any, PoolCtx], Any]:
    return lambda p, c: (lambda: f(p, c))


def _w(p: Any, s: Any, n: int, c: PoolCtx, layer: int = 0, **kw: Any) -> Any:
    k, v = rows(c, n)
    return p.write(layer, s, k, v, **kw)


def _bad_rows(make: Callable[[PoolCtx, int], tuple[Any, Any]]) -> Callable[[Any, PoolCtx], Any]:
    return _live_slots(lambda p, c, s: p.write(0, s, *make(c, len(s))))


def _changed_behind(at: int, which: str, op: str = "write") -> Callable[[Any, PoolCtx], Any]:
    """A pool-made result whose host array was changed after extend returned (the tensor
    shares its memory, so torch sees no change), then passed as the slots (``which``: the
    tensor or the array): documented as still refused, with nothing written."""

    def make(p: Any, c: PoolCtx) -> Any:
        if c.own is None or len(c.own.slots) <= max(at, -at - 1):
            return None

        def call() -> Any:
            res = c.own
            keep = res.slots.copy()
            res.slots[at] = c.num_slots + 3
            try:
                slots = res.out_cache_loc if which == "loc" else res.slots
                if op == "read":
                    return p.read(1, slots)
                return p.write(1, slots, *rows(c, len(keep)))
            finally:
                res.slots[:] = keep

        return call

    return make


def _wrong_other_dtype(c: PoolCtx) -> torch.dtype:
    return torch.float16 if c.dtype != torch.float16 else torch.float32


TORCH_LEVEL: list[tuple[str, Callable[[Any, PoolCtx], Any]]] = [
    # layer indices
    *[(f"write(layer={label})", _live_slots(lambda p, c, s, lay=lay: _w(p, s, len(s), c, layer=lay(c))))
      for label, lay in (("L", lambda c: c.num_layers), ("-1", lambda c: -1), ("-L-1", lambda c: -c.num_layers - 1),
                         ("2**63", lambda c: 2**63), ("1.5", lambda c: 1.5), ("True", lambda c: True),
                         ("'0'", lambda c: "0"), ("None", lambda c: None),
                         ("np.int64(L)", lambda c: np.int64(c.num_layers)), ("tensor(0)", lambda c: torch.tensor(0)),
                         ("array([0])", lambda c: np.array([0])))],
    ("read(layer=L)", _live_slots(lambda p, c, s: p.read(c.num_layers, s))),
    ("read(layer=-L-1)", _live_slots(lambda p, c, s: p.read(-c.num_layers - 1, s))),
    ("read(layer=1.5)", _live_slots(lambda p, c, s: p.read(1.5, s))),
    ("k_buffer(L)", _always(lambda p, c: p.k_buffer(c.num_layers))),
    ("v_buffer(-L-1)", _always(lambda p, c: p.v_buffer(-c.num_layers - 1))),
    ("k_buffer('0')", _always(lambda p, c: p.k_buffer("0"))),
    # K/V rows: shape
    ("write(k one row more)", _bad_rows(lambda c, n: rows(c, n + 1))),
    ("write(v one row fewer)", _bad_rows(lambda c, n: (rows(c, n)[0], rows(c, n + 1)[1][1:n]) if n > 1
                                         else (rows(c, n)[0], rows(c, 2)[1]))),
    ("write(k of other heads)", _bad_rows(lambda c, n: (rows(c, n, heads=c.heads + 1)[0], rows(c, n)[1]))),
    ("write(v of other head_dim)", _bad_rows(lambda c, n: (rows(c, n)[0], rows(c, n, dim=c.dim + 1)[1]))),
    ("write(k 2-D)", _bad_rows(lambda c, n: (rows(c, n)[0].reshape(n, -1), rows(c, n)[1]))),
    ("write(k [n, H, 1, D])", _bad_rows(lambda c, n: (rows(c, n)[0].unsqueeze(2), rows(c, n)[1]))),
    ("write(k 0-d)", _bad_rows(lambda c, n: (torch.tensor(1.0, dtype=c.dtype), rows(c, n)[1]))),
    ("write(v None)", _bad_rows(lambda c, n: (rows(c, n)[0], None))),
    # K/V rows: dtype, device, kind
    ("write(k float64)", _bad_rows(lambda c, n: (rows(c, n, dtype=torch.float64)[0], rows(c, n)[1]))),
    ("write(v other float)", _bad_rows(lambda c, n: (rows(c, n)[0], rows(c, n, dtype=_wrong_other_dtype(c))[1]))),
    ("write(k int32)", _bad_rows(lambda c, n: (rows(c, n, dtype=torch.int32)[0], rows(c, n)[1]))),
    ("write(k, v fp8 raw)", _bad_rows(lambda c, n: rows(c, n, dtype=torch.float8_e4m3fn))),
    ("write(k on meta)", _bad_rows(lambda c, n: (rows(c, n, device="meta")[0], rows(c, n)[1]))),
    ("write(v on meta)", _bad_rows(lambda c, n: (rows(c, n)[0], rows(c, n, device="meta")[1]))),
    ("write(k numpy)", _bad_rows(lambda c, n: (rows(c, n)[0].float().numpy(), rows(c, n)[1]))),
    ("write(k list)", _bad_rows(lambda c, n: (rows(c, n)[0].float().tolist(), rows(c, n)[1]))),
    ("write(k sparse)", _bad_rows(lambda c, n: (rows(c, n)[0].to_sparse(), rows(c, n)[1]))),
    ("write(k requires grad, wrong shape)",
     _bad_rows(lambda c, n: (rows(c, n + 1, dtype=torch.float32)[0].to(c.dtype).requires_grad_(), rows(c, n)[1]))),
    ("write(v requires grad, wrong dtype)",
     _bad_rows(lambda c, n: (rows(c, n)[0], rows(c, n, dtype=torch.float64)[1].requires_grad_()))),
    # slots
    ("write([ok.., num_slots])", _live_slots(lambda p, c, s: _w(p, [*s.tolist(), c.num_slots], len(s) + 1, c))),
    ("write([num_slots, ok..])", _live_slots(lambda p, c, s: _w(p, [c.num_slots, *s.tolist()], len(s) + 1, c))),
    ("write([ok.., 2**31])", _live_slots(lambda p, c, s: _w(p, [*s.tolist(), 2**31], len(s) + 1, c))),
    ("write([ok.., 2**63])", _live_slots(lambda p, c, s: _w(p, [*s.tolist(), 2**63], len(s) + 1, c))),
    ("write(uint64 [ok.., 2**63])",
     _live_slots(lambda p, c, s: _w(p, np.array([*s.tolist(), 2**63], np.uint64), len(s) + 1, c))),
    ("write(int64 tensor [ok.., num_slots])",
     _live_slots(lambda p, c, s: _w(p, torch.tensor([*s.tolist(), c.num_slots]), len(s) + 1, c))),
    ("write(int32 tensor [ok.., num_slots])",
     _live_slots(lambda p, c, s: _w(p, torch.tensor([*s.tolist(), c.num_slots], dtype=torch.int32), len(s) + 1, c))),
    ("write(int32 tensor [ok.., -2**31]) strict",
     _live_slots(lambda p, c, s: _w(p, torch.tensor([*s.tolist(), -2**31], dtype=torch.int32), len(s) + 1, c,
                                    strict=True))),
    ("write([ok.., -1], strict)", _live_slots(lambda p, c, s: _w(p, [*s.tolist(), -1], len(s) + 1, c, strict=True))),
    ("write([ok.., page 0], strict)", _live_slots(lambda p, c, s: _w(p, [*s.tolist(), 0], len(s) + 1, c, strict=True))),
    ("write([ok.., ok[0]], strict)",
     _live_slots(lambda p, c, s: _w(p, [*s.tolist(), int(s[0])], len(s) + 1, c, strict=True))),
    ("write(tensor [ok.., ok[0]], strict)",
     _live_slots(lambda p, c, s: _w(p, torch.tensor([*s.tolist(), int(s[0])]), len(s) + 1, c, strict=True))),
    ("write(strict='yes')", _live_slots(lambda p, c, s: _w(p, s, len(s), c, strict="yes"))),
    ("write(float slots)", _live_slots(lambda p, c, s: _w(p, s.astype(np.float64), len(s), c))),
    ("write(float tensor slots)", _live_slots(lambda p, c, s: _w(p, torch.from_numpy(s).double(), len(s), c))),
    ("write(int16 tensor slots)", _live_slots(lambda p, c, s: _w(p, torch.from_numpy(s).to(torch.int16), len(s), c))),
    ("write(bool slots)", _live_slots(lambda p, c, s: _w(p, np.ones(len(s), bool), len(s), c))),
    ("write(2-D slots)", _live_slots(lambda p, c, s: _w(p, s.reshape(1, -1), len(s), c))),
    ("write(ragged slots)", _live_slots(lambda p, c, s: _w(p, [s.tolist(), [int(s[0])]], len(s), c))),
    ("write(None slots)", _always(lambda p, c: _w(p, None, 1, c))),
    ("write(str slots)", _always(lambda p, c: _w(p, "1", 1, c))),
    ("write(slots on meta)", _live_slots(lambda p, c, s: _w(p, torch.from_numpy(s).to("meta"), len(s), c))),
    ("write(object slots with None)",
     _live_slots(lambda p, c, s: _w(p, np.array([*s.tolist(), None], dtype=object), len(s) + 1, c))),
    ("write(slots one more than rows)", _live_slots(lambda p, c, s: _w(p, [*s.tolist(), int(s[0])], len(s), c))),
    ("write(another pool's out_cache_loc)",
     _always(lambda p, c: _w(p, c.foreign_loc, int(c.foreign_loc.shape[0]), c))),
    ("write(own out_cache_loc changed behind torch's back)", _changed_behind(-1, "loc")),
    ("write(own out_cache_loc changed behind torch's back, 2nd slot)", _changed_behind(1, "loc")),
    ("write(own .slots array changed in place, 2nd slot)", _changed_behind(1, "slots")),
    ("read(own out_cache_loc changed behind torch's back)", _changed_behind(-1, "loc", "read")),
    # reads and the kernels on the pool's own caches
    ("read([ok.., num_slots])", _live_slots(lambda p, c, s: p.read(0, [*s.tolist(), c.num_slots]))),
    ("read(float slots)", _live_slots(lambda p, c, s: p.read(0, s.astype(np.float32)))),
    ("read(2-D slots)", _live_slots(lambda p, c, s: p.read(1, s.reshape(1, -1)))),
    ("gather_kv(pool caches, [ok.., num_slots])",
     _live_slots(lambda p, c, s: gather_kv(p.k_buffer(0), p.v_buffer(0), torch.tensor([*s.tolist(), c.num_slots]),
                                           k_scale=_scale(p, "k"), v_scale=_scale(p, "v")))),
    ("gather_kv(pool caches, float slots)",
     _live_slots(lambda p, c, s: gather_kv(p.k_buffer(0), p.v_buffer(0), torch.from_numpy(s).float()))),
    ("store_kv(pool caches, [ok.., num_slots])",
     _live_slots(lambda p, c, s: store_kv(p.k_buffer(1), p.v_buffer(1), torch.tensor([*s.tolist(), c.num_slots]),
                                          *_kernel_rows(p, c, len(s) + 1),
                                          k_scale=_scale(p, "k", 1), v_scale=_scale(p, "v", 1)))),
    ("store_kv(pool caches, rows of another dtype)",
     _live_slots(lambda p, c, s: store_kv(p.k_buffer(1), p.v_buffer(1), torch.from_numpy(s),
                                          *rows(c, len(s), dtype=torch.float64)))),
    ("copy_slots(pool caches, dst past the pool)",
     _live_slots(lambda p, c, s: copy_slots([p.k_buffer(0), p.v_buffer(0)], torch.from_numpy(s[:1]),
                                            torch.tensor([c.num_slots])))),
    ("copy_slots(pool caches, dst repeated)",
     _live_slots(lambda p, c, s: copy_slots([p.k_buffer(0), p.v_buffer(0)], torch.tensor([int(s[0])] * 2),
                                            torch.tensor([c.num_slots - 1] * 2)))),
    ("copy_slots(pool caches, dst also a source)",
     _live_slots(lambda p, c, s: copy_slots([p.k_buffer(0), p.v_buffer(0)],
                                            torch.tensor([int(s[0]), c.num_slots - 1]),
                                            torch.tensor([c.num_slots - 1, c.num_slots - 2])))),
    # page tables and the other queries
    ("page_table(None)", _always(lambda p, c: p.page_table(None, *_q(c)))),
    ("page_table(float handles)", _always(lambda p, c: p.page_table(np.array(c.live or [0], np.float64), *_q(c)))),
    ("page_table([live, stale])",
     lambda p, c: (lambda: p.page_table([*c.live[:1], c.pick(c.stale)], *_q(c))) if c.stale else None),
    ("slots(stale)", lambda p, c: (lambda: p.slots(c.pick(c.stale), *_q(c))) if c.stale else None),
    ("rows([live, foreign])", lambda p, c: (lambda: p.rows([*c.live[:1], c.foreign]))),
    # counts no pool can hold: refused whole (all-or-nothing, tables too)
    ("admit(more than fits)", _always(lambda p, c: p.admit([c.max_ctx] * 5))),
    ("extend(every live request, past the free pages)",
     lambda p, c: (lambda: p.extend(c.live, [c.max_ctx - c.lengths[h] for h in c.live]))
     if c.live and sum(c.max_ctx - c.lengths[h] for h in c.live) > c.room
     else None),
    ("open_with_prefix(more requests than max_requests)",
     _always(lambda p, c: p.open_with_prefix(list(range(1, 5)) * 7, [4] * 7))),
    ("fork(h, past max_requests)", lambda p, c: (lambda: p.fork(c.one(), 64)) if c.live else None),
]


def once_index(value: int, ok: int) -> OnceIndex:
    """An argument element whose own ``__index__`` answers ``ok`` times, then raises: the pool
    must read it once (a second read after the core committed left work half done)."""
    return OnceIndex(value, ok, RuntimeError("this element's __index__ fails now"))


def _flaky(call: Callable[[Any, PoolCtx, int, Callable[[int], Any]], Any]) -> Callable[[Any, PoolCtx], Any]:
    def make(p: Any, c: PoolCtx) -> Any:
        h = c.one()
        return None if h is None else (lambda: call(p, c, h, lambda x: once_index(x, 0)))

    return make


FLAKY: list[tuple[str, Callable[[Any, PoolCtx, int, Callable[[int], Any]], Any]]] = [
    ("close", lambda p, c, h, f: p.close([f(h)])),
    ("close(cache=True)", lambda p, c, h, f: p.close([f(h)], cache=True)),
    ("truncate", lambda p, c, h, f: p.truncate([f(h)], [0])),
    ("extend", lambda p, c, h, f: p.extend([f(h)], [1])),
    ("extend(count)", lambda p, c, h, f: p.extend([h], [f(1)])),
    ("fork", lambda p, c, h, f: p.fork(f(h), 1)),
    ("fork(n)", lambda p, c, h, f: p.fork(h, f(1))),
    ("cache", lambda p, c, h, f: p.cache([f(h)])),
    ("admit", lambda p, c, h, f: p.admit([f(2)])),
    ("open", lambda p, c, h, f: p.open(f(1))),
    ("write(slots)", lambda p, c, h, f: (lambda s: p.write(0, [*s[:-1].tolist(), f(int(s[-1]))], *rows(c, len(s))))(
        p.slots(h, *_q(c))) if len(p.slots(h, *_q(c))) else p.write(0, [f(c.num_slots - 1)], *rows(c, 1))),
]
# An element that raises at once: a bad call. One that answers once or twice first is a valid call
# if the pool reads it once, so the machines give it to the subject and the plain int to the twin.
FLAKY_LEVEL = [(f"{name} with an element whose __index__ raises", _flaky(call)) for name, call in FLAKY]


def _scale(p: Any, which: str, layer: int = 0) -> Any:
    s = getattr(p, "k_scale" if which == "k" else "v_scale", None)
    return None if s is None else s[layer : layer + 1]


def _kernel_rows(p: Any, c: PoolCtx, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rows(c, n)


def _noncontig(k: torch.Tensor) -> torch.Tensor:
    return k.transpose(1, 2).contiguous().transpose(1, 2)


def _overlapping(k: torch.Tensor) -> torch.Tensor:
    """Every row the same memory (stride 0 on the row axis): only the first row's values."""
    return k[:1].expand_as(k)


def _strided_rows(k: torch.Tensor) -> torch.Tensor:
    return torch.stack([k, k], dim=1)[:, 0]


# (name, make the subject's rows from the plain ones, the plain rows the twin then writes, grad mode)
ODD: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = [
    ("non-contiguous (heads and dim swapped in memory)", _noncontig, lambda k: k),
    ("strided rows (every other row of a wider tensor)", _strided_rows, lambda k: k),
    ("overlapping rows (expand of one row)", _overlapping, lambda k: k[:1].expand_as(k).contiguous()),
    ("requires grad", lambda k: k.detach().clone().requires_grad_(k.is_floating_point() and k.element_size() > 1),
     lambda k: k),
    ("a view of a leaf that requires grad", lambda k: (k.detach().clone().float().requires_grad_() * 1).to(k.dtype),
     lambda k: k),
    ("an inference tensor", lambda k: _inference(k), lambda k: k),
]


def _inference(k: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return k.clone()
