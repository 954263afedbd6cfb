"""Bad calls for tests/test_refusals_stateful.py, built from kvpool/_core.pyi.

Each entry is (name, call): `call(a, ctx)` makes one call on allocator `a` that
the stubs say must be refused. `ctx` (a Ctx) lends it live, stale and foreign
handles and the pool's shape. An entry may return None when the state it needs
is missing (no live request, no stale handle); the machine then skips it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

I64_PAST = np.array([2**63 + 5], dtype=np.uint64)


@dataclass
class Ctx:
    live: list[int]
    lengths: dict[int, int]
    prompts: dict[int, list[int]]
    stale: list[int]  # closed, and their row taken again by a newer open
    foreign: int  # an open handle of another allocator
    max_ctx: int
    page_size: int
    grouped: bool
    pick: Callable[[list[Any]], Any] = field(repr=False, default=lambda xs: xs[0])

    def one(self) -> int | None:
        return self.pick(self.live) if self.live else None


def _view(h: list[int], how: str) -> np.ndarray:
    """The same handles as a numpy view that is not a plain contiguous array."""
    base = np.asarray(h, dtype=np.int64)
    if how == "strided":
        wide = np.repeat(base, 2)
        return wide[::2]
    return np.ascontiguousarray(base[::-1])[::-1]


def _needs_live(f: Callable[[Any, Ctx, int], Any]) -> Callable[[Any, Ctx], Any]:
    def call(a: Any, c: Ctx) -> Any:
        h = c.one()
        return None if h is None else (lambda: f(a, c, h))

    return call


def _needs_stale(f: Callable[[Any, Ctx, int], Any]) -> Callable[[Any, Ctx], Any]:
    def call(a: Any, c: Ctx) -> Any:
        if not c.stale:
            return None
        return lambda: f(a, c, c.pick(c.stale))

    return call


def _always(f: Callable[[Any, Ctx], Any]) -> Callable[[Any, Ctx], Any]:
    return lambda a, c: (lambda: f(a, c))


def _len(c: Ctx, h: int) -> int:
    return c.lengths[h]


def _bad_prompt_token(c: Ctx, h: int) -> list[int] | None:
    """A token that disagrees with the prompt at the request's next position."""
    p = c.prompts.get(h, [])
    n = _len(c, h)
    return [(p[n] + 1) % 7] if n < len(p) else None


def _disagreeing_extend(a: Any, c: Ctx) -> Any:
    for h in c.live:
        t = _bad_prompt_token(c, h)
        if t is not None:
            return lambda: a.extend([h], [1], tokens=t)
    return None


def _mixed(live: int, bad: int) -> list[int]:
    return [live, bad]


# Refusals every allocator with these calls owes (SlotAllocator and GroupedAllocator).
COMMON: list[tuple[str, Callable[[Any, Ctx], Any]]] = [
    # stale, foreign and repeated handles, alone and inside a batch of good ones
    ("extend(stale)", _needs_stale(lambda a, c, s: a.extend([s], 1))),
    ("extend([live, stale])", _needs_stale(lambda a, c, s: a.extend(_mixed(c.one(), s), 1) if c.live else a.extend(s, 1))),
    ("close([live, stale])", _needs_stale(lambda a, c, s: a.close(_mixed(c.one(), s) if c.live else [s]))),
    ("close([live, stale], cache=True)",
     _needs_stale(lambda a, c, s: a.close(_mixed(c.one(), s) if c.live else [s], cache=True))),
    ("truncate([live, stale])", _needs_stale(lambda a, c, s: a.truncate(_mixed(c.one(), s) if c.live else [s], 0))),
    ("cache([live, stale])", _needs_stale(lambda a, c, s: a.cache(_mixed(c.one(), s) if c.live else [s]))),
    ("fork(stale)", _needs_stale(lambda a, c, s: a.fork(s, 1))),
    ("lengths([live, stale])", _needs_stale(lambda a, c, s: a.lengths(_mixed(c.one(), s) if c.live else [s]))),
    ("known_tokens(stale)", _needs_stale(lambda a, c, s: a.known_tokens(s))),
    ("extend([live, foreign])", _needs_live(lambda a, c, h: a.extend([h, c.foreign], 1))),
    ("close([live, foreign])", _needs_live(lambda a, c, h: a.close([h, c.foreign]))),
    ("cache([live, foreign])", _needs_live(lambda a, c, h: a.cache([h, c.foreign]))),
    ("fork(foreign)", _always(lambda a, c: a.fork(c.foreign, 1))),
    ("extend(-1 handle)", _needs_live(lambda a, c, h: a.extend([h, -1], 1))),
    ("extend([h, h])", _needs_live(lambda a, c, h: a.extend([h, h], 1))),
    ("extend([h, h], [0, 0])", _needs_live(lambda a, c, h: a.extend([h, h], [0, 0]))),
    ("close([h, h])", _needs_live(lambda a, c, h: a.close([h, h]))),
    ("close([h, h], cache=True)", _needs_live(lambda a, c, h: a.close([h, h], cache=True))),
    ("truncate([h, h])", _needs_live(lambda a, c, h: a.truncate([h, h], 0))),
    ("cache([h, h])", _needs_live(lambda a, c, h: a.cache([h, h]))),
    # handle arrays of the wrong kind
    ("extend(uint64 past int64)", _always(lambda a, c: a.extend(I64_PAST, 1))),
    ("close(uint64 past int64)", _always(lambda a, c: a.close(I64_PAST))),
    ("extend(float handles)", _needs_live(lambda a, c, h: a.extend(np.array([h], dtype=np.float64), 1))),
    ("close(float handles)", _needs_live(lambda a, c, h: a.close(np.array([h], dtype=np.float64)))),
    ("close(bool handles)", _always(lambda a, c: a.close(np.array([True, False])))),
    ("truncate(bool handles)", _always(lambda a, c: a.truncate(np.array([True]), 0))),
    ("close(object handles)", _needs_live(lambda a, c, h: a.close(np.array([h, None], dtype=object)))),
    ("cache(object handles)", _needs_live(lambda a, c, h: a.cache(np.array([h, "x"], dtype=object)))),
    ("close(2-D handles)", _needs_live(lambda a, c, h: a.close(np.array([[h]], dtype=np.int64)))),
    ("close(str)", _always(lambda a, c: a.close("0"))),
    ("close(None)", _always(lambda a, c: a.close(None))),
    ("extend(None, 1)", _always(lambda a, c: a.extend(None, 1))),
    ("cache(None)", _always(lambda a, c: a.cache(None))),
    ("truncate(None, 0)", _always(lambda a, c: a.truncate(None, 0))),
    ("lengths(None)", _always(lambda a, c: a.lengths(None))),
    ("fork(None)", _always(lambda a, c: a.fork(None, 1))),
    ("fork(array of handles)", _needs_live(lambda a, c, h: a.fork(np.array([h, h]), 1))),
    # counts and lengths
    ("extend(h, -1)", _needs_live(lambda a, c, h: a.extend([h], -1))),
    ("extend(live, [1, .., -1])", _needs_live(lambda a, c, h: a.extend(c.live[:2], [1] * (len(c.live[:2]) - 1) + [-1]))),
    ("extend(h, 2**40)", _needs_live(lambda a, c, h: a.extend([h], 2**40))),
    ("extend(h, 2**64)", _needs_live(lambda a, c, h: a.extend([h], 2**64))),
    ("extend(h, uint64 2**63)", _needs_live(lambda a, c, h: a.extend([h], np.array([2**63], dtype=np.uint64)))),
    ("extend(h, past max_context_len)", _needs_live(lambda a, c, h: a.extend([h], c.max_ctx - _len(c, h) + 1))),
    ("extend(h, 1.0)", _needs_live(lambda a, c, h: a.extend([h], 1.0))),
    ("extend(h, [1.0])", _needs_live(lambda a, c, h: a.extend([h], np.array([1.0])))),
    ("extend(h, True)", _needs_live(lambda a, c, h: a.extend([h], True))),
    ("extend(h, [True])", _needs_live(lambda a, c, h: a.extend([h], np.array([True])))),
    ("extend(h, object counts)", _needs_live(lambda a, c, h: a.extend([h], np.array([1], dtype=object)))),
    ("extend(h, None)", _needs_live(lambda a, c, h: a.extend([h], None))),
    ("extend(h, 2-D counts)", _needs_live(lambda a, c, h: a.extend([h], np.ones((1, 1), dtype=np.int64)))),
    ("extend(h, []) for 1", _needs_live(lambda a, c, h: a.extend([h], np.array([], dtype=np.int64)))),
    ("extend(h, [1, 1]) for 1", _needs_live(lambda a, c, h: a.extend([h], [1, 1]))),
    ("extend(h, '1')", _needs_live(lambda a, c, h: a.extend([h], "1"))),
    ("truncate(h, -1)", _needs_live(lambda a, c, h: a.truncate([h], -1))),
    ("truncate(h, length + 1)", _needs_live(lambda a, c, h: a.truncate([h], _len(c, h) + 1))),
    ("truncate(h, 2**63 uint64)", _needs_live(lambda a, c, h: a.truncate([h], np.array([2**63], dtype=np.uint64)))),
    ("truncate(h, [0.0])", _needs_live(lambda a, c, h: a.truncate([h], np.array([0.0])))),
    ("truncate(h, None)", _needs_live(lambda a, c, h: a.truncate([h], None))),
    ("truncate(h, [0, 0]) for 1", _needs_live(lambda a, c, h: a.truncate([h], [0, 0]))),
    ("roll_back_extend(h, length + 1)", _needs_live(lambda a, c, h: a.roll_back_extend([h], _len(c, h) + 1))),
    ("roll_back_extend([h, h])", _needs_live(lambda a, c, h: a.roll_back_extend([h, h], 0))),
    ("open(-1)", _always(lambda a, c: a.open(-1))),
    ("open(2**40)", _always(lambda a, c: a.open(2**40))),
    ("open(1.0)", _always(lambda a, c: a.open(1.0))),
    ("open(np.array([1]))", _always(lambda a, c: a.open(np.array([1])))),
    ("fork(h, -1)", _needs_live(lambda a, c, h: a.fork(h, -1))),
    ("fork(h, 2**40)", _needs_live(lambda a, c, h: a.fork(h, 2**40))),
    ("fork(h, 1.5)", _needs_live(lambda a, c, h: a.fork(h, 1.5))),
    ("admit(3) single int", _always(lambda a, c: a.admit(3))),
    ("admit(0-d array)", _always(lambda a, c: a.admit(np.array(3)))),
    ("admit([-1])", _always(lambda a, c: a.admit([-1]))),
    ("admit([past max_context_len])", _always(lambda a, c: a.admit([c.max_ctx + 1]))),
    ("admit([1.5])", _always(lambda a, c: a.admit(np.array([1.5])))),
    ("admit(None)", _always(lambda a, c: a.admit(None))),
    ("admit([1], tokens=[-1])", _always(lambda a, c: a.admit([1], tokens=[-1]))),
    ("admit([2], tokens=[1])", _always(lambda a, c: a.admit([2], tokens=[1]))),
    # token ids
    ("extend(h, 1, tokens=[-1])", _needs_live(lambda a, c, h: a.extend([h], 1, tokens=[-1]))),
    ("extend(h, 1, tokens=[2**31])", _needs_live(lambda a, c, h: a.extend([h], 1, tokens=[2**31]))),
    ("extend(h, 1, tokens=uint64 past int64)", _needs_live(lambda a, c, h: a.extend([h], 1, tokens=I64_PAST))),
    ("extend(h, 1, tokens=[0.0])", _needs_live(lambda a, c, h: a.extend([h], 1, tokens=np.array([0.0])))),
    ("extend(h, 1, tokens=[True])", _needs_live(lambda a, c, h: a.extend([h], 1, tokens=np.array([True])))),
    ("extend(h, 2, tokens=[1])", _needs_live(lambda a, c, h: a.extend([h], 2, tokens=[1]))),
    ("extend(h, 1, tokens=[1, 2])", _needs_live(lambda a, c, h: a.extend([h], 1, tokens=[1, 2]))),
    ("extend(h, 1, tokens=[]) ", _needs_live(lambda a, c, h: a.extend([h], 1, tokens=np.array([], dtype=np.int32)))),
    ("extend(tokens disagreeing with the prompt)", _disagreeing_extend),
    ("open_with_prefix(tokens=[-1])", _always(lambda a, c: a.open_with_prefix([1, -1], [2]))),
    ("open_with_prefix(tokens=[2**31])", _always(lambda a, c: a.open_with_prefix([1, 2**31], [2]))),
    ("open_with_prefix(tokens=float)", _always(lambda a, c: a.open_with_prefix(np.array([1.0, 2.0]), [2]))),
    ("open_with_prefix(tokens=uint64 past)", _always(lambda a, c: a.open_with_prefix(np.array([1, 2**63], dtype=np.uint64), [2]))),
    ("open_with_prefix(lengths past tokens)", _always(lambda a, c: a.open_with_prefix([1, 2, 3], [2, 2]))),
    ("open_with_prefix(lengths short of tokens)", _always(lambda a, c: a.open_with_prefix([1, 2, 3], [2]))),
    ("open_with_prefix(lengths=[-1])", _always(lambda a, c: a.open_with_prefix([1, 2, 3], [4, -1]))),
    ("open_with_prefix(prompt past max_context_len)",
     _always(lambda a, c: a.open_with_prefix(list(range(c.max_ctx + 1)), [c.max_ctx + 1]))),
    ("open_with_prefix(None, [1])", _always(lambda a, c: a.open_with_prefix(None, [1]))),
    ("open_with_prefix([1], None)", _always(lambda a, c: a.open_with_prefix([1], None))),
    ("open_with_prefix(salt='x')", _always(lambda a, c: a.open_with_prefix([1, 2], [2], "x"))),
    ("open_with_prefix(salt per prompt, too few)", _always(lambda a, c: a.open_with_prefix([1, 2], [1, 1], [1]))),
    ("open_with_prefix(salt=1.5)", _always(lambda a, c: a.open_with_prefix([1, 2], [2], 1.5))),
    ("open_with_prefix(2-D tokens)", _always(lambda a, c: a.open_with_prefix(np.ones((1, 2), dtype=np.int64), [2]))),
    ("close(h, cache='yes')", _needs_live(lambda a, c, h: a.close([h], cache="yes"))),
]


def _events_bad_ts(a: Any, c: Ctx) -> Any:
    return (lambda: a.take_events_msgpack(float("nan"))) if hasattr(a, "take_events_msgpack") else None


def _table(c: Ctx, rows: int, cols: int, dtype: Any = np.int32) -> np.ndarray:
    return np.zeros((rows, cols), dtype=dtype)


# SlotAllocator only: its out=, table=, priorities, pins, chain hashes and evict(n).
SLOT_ONLY: list[tuple[str, Callable[[Any, Ctx], Any]]] = [
    ("evict(-1)", _always(lambda a, c: a.evict(-1))),
    ("evict(1.5)", _always(lambda a, c: a.evict(1.5))),
    ("evict(None)", _always(lambda a, c: a.evict(None))),
    ("evict(2**64)", _always(lambda a, c: a.evict(2**64))),
    ("unpin([h, h])", _needs_live(lambda a, c, h: a.unpin([h, h]))),
    ("unpin([live, stale])", _needs_stale(lambda a, c, s: a.unpin(_mixed(c.one(), s) if c.live else [s]))),
    ("unpin(float)", _needs_live(lambda a, c, h: a.unpin(np.array([h], dtype=np.float64)))),
    ("cache(h, priority=101)", _needs_live(lambda a, c, h: a.cache([h], priority=101))),
    ("cache(h, priority=[1, 2]) for 1", _needs_live(lambda a, c, h: a.cache([h], priority=[1, 2]))),
    ("cache(h, priority=uint64 past)", _needs_live(lambda a, c, h: a.cache([h], priority=I64_PAST))),
    ("cache(h, priority=5, retain_s=-1)", _needs_live(lambda a, c, h: a.cache([h], priority=5, retain_s=-1))),
    ("close(h, cache=True, priority=-1)", _needs_live(lambda a, c, h: a.close([h], cache=True, priority=-1))),
    ("close(h, priority=5) without cache", _needs_live(lambda a, c, h: a.close([h], priority=5))),
    ("set_clock(back)", _always(lambda a, c: a.set_clock(-1.0))),
    ("extend(out=too short)", _needs_live(lambda a, c, h: a.extend([h], 2, out=np.zeros(1, np.int64)))),
    ("extend(out=int32)", _needs_live(lambda a, c, h: a.extend([h], 1, out=np.zeros(4, np.int32)))),
    ("extend(out=read-only)", _needs_live(lambda a, c, h: a.extend([h], 1, out=_ro(4)))),
    ("extend(out=strided)", _needs_live(lambda a, c, h: a.extend([h], 1, out=np.zeros(8, np.int64)[::2]))),
    ("extend(out=2-D)", _needs_live(lambda a, c, h: a.extend([h], 1, out=np.zeros((2, 2), np.int64)))),
    ("extend(table=int64)", _needs_live(lambda a, c, h: a.extend([h], 1, table=_table(c, 64, c.max_ctx, np.int64)))),
    ("extend(table=too few rows)", _needs_live(lambda a, c, h: a.extend([h], 1, table=_table(c, 1, c.max_ctx)))),
    ("extend(table=too few cols)", _needs_live(lambda a, c, h: a.extend([h], 1, table=_table(c, 64, 1)))),
    ("extend(table=1-D)", _needs_live(lambda a, c, h: a.extend([h], 1, table=np.zeros(64, np.int32)))),
    ("extend(table=read-only)", _needs_live(lambda a, c, h: a.extend([h], 1, table=_ro_table(c)))),
    ("extend(table=, out= overlapping)", _needs_live(lambda a, c, h: _overlap(a, c, h))),
    ("extend_with_starts([h, h])", _needs_live(lambda a, c, h: a.extend_with_starts([h, h], 1))),
    ("extend_with_starts(h, -1)", _needs_live(lambda a, c, h: a.extend_with_starts([h], -1))),
    ("extend_packed(h, past max_context_len)",
     _needs_live(lambda a, c, h: a.extend_packed([h], c.max_ctx - _len(c, h) + 1))),
    ("extend_packed([live, stale])", _needs_stale(lambda a, c, s: a.extend_packed(_mixed(c.one(), s) if c.live else [s], 1))),
    ("extend_packed(tokens=[-1])", _needs_live(lambda a, c, h: a.extend_packed([h], 1, tokens=[-1]))),
    ("admit_packed([-1])", _always(lambda a, c: a.admit_packed([-1]))),
    ("admit_packed([1], tokens=[2**31])", _always(lambda a, c: a.admit_packed([1], tokens=[2**31]))),
    ("admit(out=too short)", _always(lambda a, c: a.admit([2], out=np.zeros(1, np.int64)))),
    ("admit(table=int64)", _always(lambda a, c: a.admit([1], table=_table(c, 64, c.max_ctx, np.int64)))),
    ("open_with_prefix(table=too small)", _always(lambda a, c: a.open_with_prefix([1, 2], [2], table=_table(c, 1, 1)))),
    ("fork(h, 1, table=int64)", _needs_live(lambda a, c, h: a.fork(h, 1, table=_table(c, 64, c.max_ctx, np.int64)))),
    ("fork(h, 1, table=too few rows)", _needs_live(lambda a, c, h: a.fork(h, 1, table=_table(c, 1, c.max_ctx)))),
    ("match_chain_hashes(odd words)", _always(lambda a, c: a.match_chain_hashes(np.zeros(3, np.uint64), [0] * c.page_size))),
    ("match_chain_hashes(float hashes)", _always(lambda a, c: a.match_chain_hashes(np.zeros(2), [0] * c.page_size))),
    ("open_with_chain_hashes(tokens short)",
     _always(lambda a, c: a.open_with_chain_hashes(np.zeros(2, np.uint64), [0] * (c.page_size + 1)))),
    ("open_with_chain_hashes(max_pages=-1)",
     _always(lambda a, c: a.open_with_chain_hashes(np.zeros(2, np.uint64), [0] * c.page_size, max_pages=-1))),
    ("open_with_chain_hashes(length past max_context_len)",
     _always(lambda a, c: a.open_with_chain_hashes(np.zeros(0, np.uint64), [], length=c.max_ctx + 1))),
    ("open_with_chain_hashes(tokens=[-1]*P)",
     _always(lambda a, c: a.open_with_chain_hashes(np.zeros(2, np.uint64), [-1] * c.page_size))),
    ("take_events_msgpack(nan)", _events_bad_ts),
    ("swap_out without a host tier", _needs_live(lambda a, c, h: a.swap_out([h]))),
]


def _ro(n: int) -> np.ndarray:
    x = np.zeros(n, np.int64)
    x.setflags(write=False)
    return x


def _ro_table(c: Ctx) -> np.ndarray:
    t = _table(c, 64, c.max_ctx)
    t.setflags(write=False)
    return t


def _overlap(a: Any, c: Ctx, h: int) -> Any:
    """out= that aliases the table's memory (documented refusal)."""
    t = np.zeros((64, c.max_ctx * 2), dtype=np.int32)
    out = t.view(np.int64).reshape(-1)
    return a.extend([h], 1, table=t, out=out)


# GroupedAllocator only: calls that name a group.
GROUPED_ONLY: list[tuple[str, Callable[[Any, Ctx], Any]]] = [
    ("evict(no such group, 1)", _always(lambda a, c: a.evict(99, 1))),
    ("evict(-1 group, 1)", _always(lambda a, c: a.evict(-1, 1))),
    ("evict(0, -1)", _always(lambda a, c: a.evict(0, -1))),
    ("evict(0, 1.5)", _always(lambda a, c: a.evict(0, 1.5))),
    ("evict(0, None)", _always(lambda a, c: a.evict(0, None))),
    ("extend(tables=[int64])", _needs_live(lambda a, c, h: a.extend([h], 1, tables=[_table(c, 64, c.max_ctx, np.int64), None, None]))),
    ("extend(tables= too few)", _needs_live(lambda a, c, h: a.extend([h], 1, tables=[None]))),
    ("extend(tables= same table twice)",
     _needs_live(lambda a, c, h: (lambda t: a.extend([h], 1, tables=[t, t, None]))(_table(c, 64, c.max_ctx)))),
    ("extend(tables='x')", _needs_live(lambda a, c, h: a.extend([h], 1, tables="x"))),
    ("admit(tables= too few)", _always(lambda a, c: a.admit([1], tables=[None]))),
    ("fill_table(state group)", _needs_live(lambda a, c, h: a.fill_table([h], _table(c, 64, c.max_ctx), 2))),
    ("fill_table(int64 table)", _needs_live(lambda a, c, h: a.fill_table([h], _table(c, 64, c.max_ctx, np.int64), 0))),
    ("fill_table([live, stale])", _needs_stale(lambda a, c, s: a.fill_table([s], _table(c, 64, c.max_ctx), 0))),
    ("take_copies(99)", _always(lambda a, c: a.take_copies(99))),
    ("take_copies(-1)", _always(lambda a, c: a.take_copies(-1))),
    ("slots(h, state group)", _needs_live(lambda a, c, h: a.slots(h, 2))),
    ("state_slots(h, page group)", _needs_live(lambda a, c, h: a.state_slots([h], 0))),
]


def _two(f: Callable[[Any, Ctx, int, int], Any]) -> Callable[[Any, Ctx], Any]:
    """A batch of two live requests whose second element is the bad one, so a call
    that acts on elements in order before checking them all shows it."""

    def call(a: Any, c: Ctx) -> Any:
        if len(c.live) < 2:
            return None
        h1, h2 = c.live[0], c.pick(c.live[1:])
        return lambda: f(a, c, h1, h2)

    return call


def _prompted_second(a: Any, c: Ctx) -> Any:
    for h in c.live:
        t = _bad_prompt_token(c, h)
        others = [x for x in c.live if x != h]
        if t is not None and others:
            return lambda: a.extend([others[0], h], [1, 1], tokens=[0] + t)
    return None


# The bad element last in an otherwise good batch.
LATE: list[tuple[str, Callable[[Any, Ctx], Any]]] = [
    ("extend([h1, h2], [1, past max_context_len])",
     _two(lambda a, c, h1, h2: a.extend([h1, h2], [1, c.max_ctx - c.lengths[h2] + 1]))),
    ("extend([h1, h2], tokens=[0, -1])", _two(lambda a, c, h1, h2: a.extend([h1, h2], [1, 1], tokens=[0, -1]))),
    ("extend([h1, h2], [1, 2**62])", _two(lambda a, c, h1, h2: a.extend([h1, h2], [1, 2**62]))),
    ("extend([h1, prompted], tokens disagreeing in the second)", _prompted_second),
    ("truncate([h1, h2], [0, length + 1])",
     _two(lambda a, c, h1, h2: a.truncate([h1, h2], [0, c.lengths[h2] + 1]))),
    ("roll_back_extend([h1, h2], [0, -1])", _two(lambda a, c, h1, h2: a.roll_back_extend([h1, h2], [0, -1]))),
    ("close([h1, h2, h1], cache=True)", _two(lambda a, c, h1, h2: a.close([h1, h2, h1], cache=True))),
    ("open_with_prefix(a hit, then a prompt past max_context_len)",
     _always(lambda a, c: a.open_with_prefix(list(range(3)) + list(range(c.max_ctx + 1)), [3, c.max_ctx + 1]))),
    ("open_with_prefix(a hit, then a token of -1)",
     _always(lambda a, c: a.open_with_prefix([1, 6, 4, 2, 0, 5] * 4 + [1, -1], [24, 2]))),
    ("open_with_prefix(a hit, then salts one short)",
     _always(lambda a, c: a.open_with_prefix([1, 6, 4, 2, 0, 5] * 4 + [1, 2], [24, 2], [0]))),
    ("admit([1, past max_context_len])", _always(lambda a, c: a.admit([1, c.max_ctx + 1]))),
    ("admit([1, 1], tokens=[0, -1])", _always(lambda a, c: a.admit([1, 1], tokens=[0, -1]))),
    ("admit([1, -1])", _always(lambda a, c: a.admit([1, -1]))),
]

SLOT_LATE: list[tuple[str, Callable[[Any, Ctx], Any]]] = [
    ("cache([h1, h2], priority=[5, 101])", _two(lambda a, c, h1, h2: a.cache([h1, h2], priority=[5, 101]))),
    ("close([h1, h2], cache=True, priority=[100, -1])",
     _two(lambda a, c, h1, h2: a.close([h1, h2], cache=True, priority=[100, -1]))),
    ("unpin([h1, h2, h1])", _two(lambda a, c, h1, h2: a.unpin([h1, h2, h1]))),
    ("extend_packed([h1, h2], [1, past])",
     _two(lambda a, c, h1, h2: a.extend_packed([h1, h2], [1, c.max_ctx - c.lengths[h2] + 1]))),
    ("extend([h1, h2], out= one short)",
     _two(lambda a, c, h1, h2: a.extend([h1, h2], [2, 2], out=np.zeros(3, np.int64)))),
    ("admit_packed([1, past])", _always(lambda a, c: a.admit_packed([1, c.max_ctx + 1]))),
]
