"""Tensor-parallel pools that agree: deterministic allocators plus a cheap divergence check.

Mode: every rank runs the *same* pool calls with the same arguments, and the
allocator is deterministic, so every rank hands out the same handles and slots
(LIFO free stack, row reuse order and handle generations are pure functions of
the call sequence; hashes too, given the same ``hash_seed``). Nothing is
broadcast on the step path. ``TPPool`` proves it cheaply: it folds every
mutating call (its arguments and its result) and a snapshot of the allocator's
counters into a running 16-byte digest, and every ``check_every`` steps compares
the digests of all ranks with one ``all_gather``, raising
``RankDivergenceError`` that names the first rank that differs.

Retention durations (``cache(..., priority=, retain_s=)``) end by the pool's
clock, and each rank's system clock reads differently: a duration ending
between two ranks' evictions would evict different pages. Ranks that give
durations build their pools with ``manual_clock=True`` and call
``set_clock(t)`` with the same ``t`` on every rank (the step's time as the
scheduler sees it, broadcast, or the step count); ``set_clock`` is recorded.
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import secrets
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from kvpool.distributed.comm import comm_device, group_ranks
from kvpool.distributed.errors import RankDivergenceError
from kvpool.errors import InvalidArgumentError
from kvpool.modes import persistent
from kvpool.torch_types import as_device
from kvpool.validate import check_pool, is_int

__all__ = ["TPPool", "agree_seed", "tp_pool", "MUTATING_CALLS"]

#: Pool calls that change allocator state (the ones the digest records); a call
#: the wrapped pool does not have is skipped. ``recv_request(tp_pool, ...)``
#: is recorded through the calls it makes on the proxy (open_with_chain_hashes, or open and
#: extend; close when it fails after the open).
MUTATING_CALLS = ("open", "admit", "extend", "truncate", "close", "reset",
                  "open_with_prefix", "open_with_chain_hashes", "cache", "fork", "evict", "clear_cache",
                  "unpin", "set_clock", "swap_out", "swap_in")
#: Private pool calls that change allocator state, made by kvpool's own consumers of a pool
#: (``KVPoolCache.crop`` shortens its rows with ``_truncate_keeping_prompts``): recorded too, or
#: ``__getattr__`` would hand the inner pool's call out and the digest would miss it.
_PRIVATE_MUTATING_CALLS = ("_truncate_keeping_prompts",)
#: Seed keyword names a pool may take; ``tp_pool`` passes the agreed seed to each one it has.
SEED_KWARGS = ("hash_seed", "handle_seed", "seed")


def _bytes(x: Any) -> bytes:
    if x is None:
        return b"-"
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if hasattr(x, "slots") and isinstance(x.slots, np.ndarray):  # ExtendResult
        x = x.slots
    if isinstance(x, (tuple, list)) and any(isinstance(v, (np.ndarray, torch.Tensor, tuple, list)) for v in x):
        return b"(" + b",".join(_bytes(v) for v in x) + b")"
    try:
        arr = np.asarray(x)
    except Exception:  # noqa: BLE001 - anything unusual still goes into the digest
        return repr(x).encode()
    if arr.dtype.kind in "iub":
        return arr.astype(np.int64, copy=False).tobytes()
    return repr(x).encode()


def agree_seed(group: Any = None, device: torch.device | None = None) -> int:
    """A random 63-bit seed drawn on the group's first rank and broadcast to all (one collective)."""
    dev = comm_device(group, torch.device("cpu"), "agree_seed")
    if device is not None:  # (checked before the collective, the same way on every rank)
        dev = as_device(device)
        if dev.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"agree_seed: device {device!r} cannot carry a collective; pass 'cpu' "
                                       "(gloo), a CUDA device (nccl), or None for the group's")
    with persistent():  # (collectives write their tensors outside inference mode: see verify)
        t = torch.tensor([secrets.randbits(63)], dtype=torch.int64, device=dev)
        dist.broadcast(t, src=group_ranks(group, "agree_seed")[0], group=group)
    return int(t.item())


if TYPE_CHECKING:  # the pool's attributes and calls pass through (__getattr__): type checkers see them
    from kvpool.pool import KVPool as _PoolSurface
else:  # (and its own copy and pickle refusals: through __getattr__ they were the pool's, naming a KVPool)
    from kvpool._nopickle import NotPicklable as _PoolSurface


class TPPool(_PoolSurface):
    """A KVPool proxy for one tensor-parallel rank that records and checks agreement.

    Use it exactly like the pool (attributes and non-mutating calls pass
    through). Args: ``pool`` (this rank's ``KVPool``), ``group`` (the TP
    process group; None = world), ``check_every`` (compare digests every N
    ``extend`` calls, i.e. steps; 0 = only when ``verify()`` is called). Every
    rank must make the same calls, so the automatic check runs at the same
    point on every rank.
    """

    _pickle_refusal = "it wraps this rank's KVPool and process group"
    _copy_refusal = "a copy would record and check the same pool's calls twice; wrap the pool once per rank"

    def __init__(self, pool: Any, group: Any = None, check_every: int = 0) -> None:
        if not is_int(check_every) or check_every < 0:
            raise InvalidArgumentError(f"check_every must be an int >= 0, got {check_every!r}")
        if isinstance(pool, TPPool):  # (it recorded every call twice, each digest step apart)
            raise InvalidArgumentError("pool is already a TPPool: wrap the KVPool once (TPPool(pool.inner, group))")
        check_pool(pool, "TPPool", ("device",))
        if getattr(pool, "groups", None) is not None:
            raise InvalidArgumentError("TPPool wraps a plain KVPool: a pool built with layer_types (a hybrid "
                                       "model) has no tensor-parallel form (tp_size > 1 is refused there); run "
                                       "it without TPPool")
        self.inner, self.group, self.check_every = pool, group, int(check_every)
        self._hash = hashlib.blake2b(digest_size=16)
        self.calls = 0
        self._steps = 0
        self._device = comm_device(group, torch.device(pool.device), "TPPool")
        for name in MUTATING_CALLS + _PRIVATE_MUTATING_CALLS:
            fn = getattr(pool, name, None)
            if fn is not None:
                setattr(self, name, self._recorded(name, fn))

    def _recorded(self, name: str, fn: Any) -> Any:
        # A weak reference: the call is an attribute of this TPPool, and a closure over it made a
        # cycle that kept a dropped TPPool and its pool's memory until the cyclic collector ran.
        me = weakref.ref(self)

        def call(*args: Any, **kwargs: Any) -> Any:
            tp = me()
            if tp is None:  # (a call kept past its TPPool: nothing is left to record it)
                return fn(*args, **kwargs)
            try:
                out = fn(*args, **kwargs)
            except Exception as e:
                # A failure is a decision too: every rank must fail the same way. A refused
                # extend counts as a step, so a rank whose extend succeeded where this one's
                # failed still meets it in the same verify (else one all_gather would meet the
                # model's next collective and both ranks would hang until the group timeout).
                tp._fold(name, args, kwargs, type(e).__name__)
                if name == "extend" and tp._step_due():
                    try:
                        tp.verify()
                    except RankDivergenceError as d:
                        raise d from e
                raise
            tp._fold(name, args, kwargs, out)
            if name == "extend" and tp._step_due():
                tp.verify()
            return out
        call.__name__ = name
        call.__doc__ = getattr(fn, "__doc__", None)
        call.__wrapped__ = fn  # type: ignore[attr-defined]  # inspect.signature shows fn's parameters
        return call

    def _step_due(self) -> bool:
        self._steps += 1
        return bool(self.check_every) and self._steps % self.check_every == 0

    def _fold(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        h = self._hash

        def part(b: bytes) -> None:
            # Length-prefixed, so ([1, 2], [3]) and ([1], [2, 3]) never fold alike.
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)

        part(name.encode())
        for a in args:
            part(_bytes(a))
        for k in sorted(kwargs):
            part(k.encode())
            part(_bytes(kwargs[k]))
        h.update(b"=")
        part(_bytes(out))
        self.calls += 1

    def digest(self) -> bytes:
        """16 bytes: every recorded call and result, plus the allocator's current counters."""
        a = self.inner
        h = self._hash.copy()
        h.update(np.array([a.free_pages, a.used_pages, a.open_requests, a.used_slots, self.calls],
                          dtype=np.int64).tobytes())
        return h.digest()

    def verify(self) -> None:
        """Compare this rank's digest with every other rank's (one all_gather of 3 int64s).

        Raises ``RankDivergenceError`` on every rank when any rank differs from the
        group's first rank, naming the first differing global rank. A collective:
        every rank of the group must call it at the same point.
        """
        d = np.frombuffer(self.digest(), dtype=np.int64)
        ranks = group_ranks(self.group)
        # Outside inference mode: verify runs inside the engine's extend, and torch 2.4's gloo
        # writes a collective's outputs from a thread outside it, which refuses inference tensors.
        with persistent():
            mine = torch.tensor([d[0], d[1], self.calls], dtype=torch.int64, device=self._device)
            out = [torch.empty_like(mine) for _ in ranks]
            dist.all_gather(out, mine, group=self.group)
        rows = [tuple(int(v) for v in t.cpu()) for t in out]
        bad = tuple(r for r, row in zip(ranks, rows) if row != rows[0])
        if bad:
            first = bad[0]
            raise RankDivergenceError(
                f"tensor-parallel ranks diverged: rank {first}'s allocator digest differs from rank "
                f"{ranks[0]}'s after {rows[ranks.index(first)][2]} vs {rows[0][2]} recorded pool calls "
                f"(differing ranks: {list(bad)}). Every rank must make the same pool calls with the same "
                f"arguments in the same order, on pools built with the same shape and seeds.",
                rank=first, ranks=bad,
            )

    def _extend_host(self, handles: Any, counts: Any, out: Any = None) -> None:
        """None: ``KVPool._extend_host`` (a CPU pool's extend without the tensor, which
        ``KVPoolCache`` steps with) is the allocator's call alone, and reached through
        ``__getattr__`` it would go around the digest; so the cache calls the recorded
        ``extend`` (on CUDA ``_extend_host`` is None anyway)."""
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"TPPool({self.inner!r}, calls={self.calls}, check_every={self.check_every})"


def tp_pool(*args: Any, group: Any = None, check_every: int = 64, seed: int | None = None, **kwargs: Any) -> TPPool:
    """Build this rank's ``KVPool`` of a tensor-parallel group and wrap it in ``TPPool``.

    ``args``/``kwargs`` are ``KVPool``'s, with ``num_kv_heads`` the model's total;
    ``tp_rank``/``tp_size`` come from ``group`` (given, they must be the group's:
    ``InvalidArgumentError`` otherwise, before any collective). One seed, drawn on the group's
    first rank and broadcast (or ``seed=`` given identically on every rank), is
    passed to every seed keyword the installed ``KVPool`` accepts
    (``hash_seed``, ``handle_seed``, ``seed``), so randomized hashes and handle
    offsets are still identical across ranks. A pool sized by ``memory_bytes`` or
    ``memory_fraction`` (or its host tier by ``host_memory_bytes``) gets the smallest
    capacity any rank's budget gives (one collective), so every rank has the same
    ``num_pages`` (and host pages); a rank whose budget builds no pool raises its own
    error, and the others an ``InvalidArgumentError`` naming it.
    """
    from kvpool.pool import KVPool

    params = inspect.signature(KVPool.__init__).parameters
    wanted = [k for k in SEED_KWARGS if k in params and k not in kwargs]
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**63):  # (used or not: a typo is a typo)
        raise InvalidArgumentError(f"seed must be None (drawn on the group's first rank) or an int in "
                                   f"[0, 2**63), the same on every rank; got {type(seed).__name__} {seed!r}")
    ranks = group_ranks(group, "tp_pool")  # (refuses a missing group before any collective)
    if kwargs.get("layer_types") is not None:  # (every rank passes the same: all refuse here)
        raise InvalidArgumentError("tp_pool: a pool built with layer_types (a hybrid model) has no "
                                   "tensor-parallel form yet; build KVPool(layer_types=...) on each process "
                                   "without tp_pool or TPPool")
    me = ranks.index(dist.get_rank())
    # The shard is the group's: another rank or size would give this rank heads its peers
    # also hold (or none), found only as wrong attention or a shape error at the first write.
    for key, want in (("tp_size", len(ranks)), ("tp_rank", me)):
        got = kwargs.setdefault(key, want)
        if not (is_int(got) and int(got) == want):
            raise InvalidArgumentError(
                f"tp_pool: {key}={got!r} but this rank is rank {me} of a group of {len(ranks)}; leave "
                f"{key} out (tp_pool takes it from group), or build KVPool(tp_rank=, tp_size=) yourself "
                "and wrap it in TPPool")
    if wanted:
        s = agree_seed(group) if seed is None else int(seed)
        kwargs.update({k: s for k in wanted})
    budget = [k for k in ("memory_bytes", "memory_fraction", "host_memory_bytes") if kwargs.get(k) is not None]
    if not budget:
        return TPPool(KVPool(*args, **kwargs), group=group, check_every=check_every)
    # A budget (memory_fraction above all: each device's own free memory) can give the
    # ranks different capacities, and then they decide differently once the smallest
    # fills: every rank takes the smallest, rebuilt after freeing its own. A rank whose
    # budget builds no pool still joins that collective (with -1), so its peers fail too
    # rather than wait in it alone until the group's timeout.
    pool, failed = None, None
    try:
        pool = KVPool(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the collective
        failed = e
    # (the failed rank's own device argument may be what failed: the group's default then)
    where = comm_device(group, torch.device("cpu") if pool is None else torch.device(pool.device))
    # (host pages too: a host_memory_bytes from each machine's free memory differs as well)
    with persistent():  # (outside inference mode: see verify)
        mine = torch.tensor([-1, -1] if pool is None else [pool.num_pages, pool.allocator.host_pages],
                            dtype=torch.int64, device=where)
        sizes_of = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(sizes_of, mine, group=group)
    counts = [int(t[0].item()) for t in sizes_of]
    if failed is not None or pool is None:
        raise failed or InvalidArgumentError("tp_pool: no pool was built")
    if min(counts) < 0:
        raise InvalidArgumentError(
            f"tp_pool: rank {ranks[counts.index(-1)]} could not build its pool from its budget "
            f"({', '.join(f'{k}={kwargs[k]!r}' for k in budget)} here; that rank raised why), so no rank "
            "builds one: give every rank a budget that holds the pool")
    pages, host = min(counts), min(int(t[1].item()) for t in sizes_of)
    if (pages, host) != (pool.num_pages, pool.allocator.host_pages):
        del pool
        gc.collect()
        for k in budget:
            del kwargs[k]
        if "host_memory_bytes" in budget:
            kwargs["host_pages"] = host
        if "memory_bytes" in budget or "memory_fraction" in budget:
            kwargs["num_pages"] = pages
        pool = KVPool(*args, **kwargs)
    return TPPool(pool, group=group, check_every=check_every)
