"""Bad inputs raise their typed error and leave the pool exactly as it was.

Each case snapshots every pool tensor and the allocator's state, makes the bad
call, and compares. Page 0 policy: the allocator never hands out page 0, so a
real request cannot own a page-0 slot; write() accepts page-0 slots as padding
(the null-block convention the graph runner pads with) and ``strict=True``
rejects them with ``ReservedSlotError`` for batches that should have no padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import kvpool
from kvpool import (
    ContextTooLongError,
    InvalidArgumentError,
    InvalidHandleError,
    KVPoolError,
    LayerIndexError,
    PoolExhaustedError,
    ReservedSlotError,
    SlotRangeError,
    TensorDeviceError,
    TensorDtypeError,
    TensorShapeError,
)

H, D, PAGE = 2, 4, 4
# torch.float8_e8m0fnu is 2.7+ (pyproject's floor is 2.4): cased only where torch has it
E8M0 = [torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else []


def make_pool(**kw: Any) -> tuple[kvpool.KVPool, np.ndarray, np.ndarray]:
    """A pool with two open requests (one slot batch written) and one closed handle."""
    args: dict[str, Any] = dict(dtype=torch.float16, page_size=PAGE, num_pages=6, max_requests=3, max_context_len=12)
    args.update(kw)
    pool = kvpool.KVPool(2, H, D, **args)
    handles = pool.open(3)
    res = pool.extend(handles, [5, 3, 2])
    k = torch.randn(10, H, D).to(pool.compute_dtype)
    pool.write(0, res.slots, k, k if not pool.mla else None) if not pool.mla else pool.write(0, res.slots, k)
    pool.close(handles[2])
    return pool, handles[:2], np.array([handles[2]])


def snapshot(pool: kvpool.KVPool, handles: np.ndarray) -> dict[str, Any]:
    a = pool.allocator
    state: dict[str, Any] = {name: t.clone() for name, t in pool.named_tensors()}
    state["alloc"] = (a.free_pages, a.used_pages, a.open_requests, [a.slots(h).tolist() for h in handles])
    return state


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if isinstance(before[key], torch.Tensor):
            # Compare bytes: NaN-safe and exact for fp8.
            assert torch.equal(before[key].view(torch.uint8), after[key].view(torch.uint8)), key
        else:
            assert before[key] == after[key], key


def good(n: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.ones(n, H, D).to(dtype)  # torch 2.4 has no CPU fill of fp8


NOT_A_TENSOR: Any = np.ones((1, H, D))

# (name, expected error, call) — every call must fail before touching anything.
CASES: list[tuple[str, type[Exception], Callable[[kvpool.KVPool, np.ndarray, np.ndarray], Any]]] = [
    ("k wrong dtype", TensorDtypeError, lambda p, h, c: p.write(0, [4, 5], good(2, torch.float32), good(2))),
    ("v wrong dtype", TensorDtypeError, lambda p, h, c: p.write(0, [4, 5], good(2), good(2, torch.bfloat16))),
    ("k not a tensor", TensorDtypeError, lambda p, h, c: p.write(0, [4], NOT_A_TENSOR, good(1))),
    ("k wrong head_dim", TensorShapeError, lambda p, h, c: p.write(0, [4, 5], torch.ones(2, H, D + 1).half(), good(2))),
    ("k wrong heads", TensorShapeError, lambda p, h, c: p.write(0, [4, 5], torch.ones(2, H + 1, D).half(), good(2))),
    ("rows != slots", TensorShapeError, lambda p, h, c: p.write(0, [4, 5, 6], good(2), good(2))),
    ("v missing", TensorShapeError, lambda p, h, c: p.write(0, [4, 5], good(2))),
    ("slots 2-D", TensorShapeError, lambda p, h, c: p.write(0, [[4, 5]], good(2), good(2))),
    ("slots float", TensorDtypeError, lambda p, h, c: p.write(0, torch.tensor([4.0, 5.0]), good(2), good(2))),
    ("slots int16", TensorDtypeError, lambda p, h, c: p.write(0, torch.tensor([4, 5], dtype=torch.int16), good(2), good(2))),
    ("k wrong device", TensorDeviceError,
     lambda p, h, c: p.write(0, [4, 5], torch.empty(2, H, D, dtype=torch.float16, device="meta"), good(2))),
    ("slots wrong device", TensorDeviceError,
     lambda p, h, c: p.write(0, torch.tensor([4, 5], device="meta"), good(2), good(2))),
    ("slot == num_slots", SlotRangeError, lambda p, h, c: p.write(0, [4, p.num_slots], good(2), good(2))),
    ("slot far out of range", SlotRangeError, lambda p, h, c: p.write(1, np.array([2**40]), good(1), good(1))),
    ("page 0 slot, strict", ReservedSlotError, lambda p, h, c: p.write(0, [4, 0], good(2), good(2), strict=True)),
    ("padding slot, strict", ReservedSlotError, lambda p, h, c: p.write(0, [4, -1], good(2), good(2), strict=True)),
    ("layer out of range", LayerIndexError, lambda p, h, c: p.write(2, [4], good(1), good(1))),
    ("negative layer", LayerIndexError, lambda p, h, c: p.k_buffer(-1)),
    ("read slot out of range", SlotRangeError, lambda p, h, c: p.read(0, [p.num_slots + 3])),
    ("extend closed handle", InvalidHandleError, lambda p, h, c: p.extend(np.concatenate([h, c]), 1)),
    ("truncate closed handle", InvalidHandleError, lambda p, h, c: p.truncate(c, 0)),
    ("close closed handle", InvalidHandleError, lambda p, h, c: p.close(c)),
    ("page_table closed handle", InvalidHandleError, lambda p, h, c: p.page_table(c)),
    ("extend past free pages", PoolExhaustedError, lambda p, h, c: p.extend(h, [4, 9])),
    ("extend past max_context_len", ContextTooLongError, lambda p, h, c: p.extend(h, [8, 0])),
    ("extend negative count", InvalidArgumentError, lambda p, h, c: p.extend(h, [1, -1])),
    ("duplicate handles", InvalidArgumentError, lambda p, h, c: p.extend([h[0], h[0]], 1)),
    ("truncate longer", InvalidArgumentError, lambda p, h, c: p.truncate(h, [6, 0])),
]


@pytest.mark.parametrize("name,error,call", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_typed_error_and_changes_nothing(name: str, error: type[Exception], call: Callable) -> None:
    pool, handles, closed = make_pool()
    before = snapshot(pool, handles)
    with pytest.raises(error) as info:
        call(pool, handles, closed)
    assert isinstance(info.value, KVPoolError)
    assert str(info.value)  # says what was wrong
    assert_unchanged(before, snapshot(pool, handles))
    pool.allocator.check()


def test_torch_layer_errors_are_invalid_argument_errors() -> None:
    for cls in (TensorDtypeError, TensorShapeError, TensorDeviceError, SlotRangeError, LayerIndexError):
        assert issubclass(cls, InvalidArgumentError) and issubclass(cls, ValueError)
    assert issubclass(ReservedSlotError, SlotRangeError)


@pytest.mark.parametrize("layout", ["token", "paged"])
def test_real_requests_never_get_page_0_and_page_0_writes_are_only_padding(layout: str) -> None:
    pool = kvpool.KVPool(1, H, D, dtype=torch.float32, page_size=PAGE, num_pages=5, max_requests=4,
                         max_context_len=16, layout=layout)
    handles = pool.open(4)
    res = pool.extend(handles, [4, 4, 3, 4])  # fills every usable page
    assert pool.allocator.free_pages == 0
    assert res.slots.min() >= PAGE  # no slot of page 0 is ever handed out
    # A padded batch: real rows plus padding to slot 0 (page 0) and -1 (skipped).
    slots = torch.tensor(res.slots.tolist() + [0, -1])
    k = torch.arange(len(slots), dtype=torch.float32)[:, None, None].expand(-1, H, D).contiguous()
    pool.write(0, slots, k, k + 100)
    flat = pool.k_buffer(0).reshape(pool.num_slots, H, D)
    for i, s in enumerate(res.slots.tolist()):
        assert torch.equal(flat[s], k[i])
    assert torch.equal(flat[0], k[len(res.slots)])  # the padding row landed in the sink
    # No real request reads page 0: every request's slots avoid it.
    for h in handles:
        assert (pool.allocator.slots(h) >= PAGE).all()
    # The same batch without padding passes strict mode.
    pool.write(0, res.slots, k[: len(res.slots)], k[: len(res.slots)], strict=True)


def test_write_checks_all_arguments_before_writing_any_cache() -> None:
    # k is fine, v is bad: K must not have been written before v's check failed.
    pool, handles, _ = make_pool()
    before = snapshot(pool, handles)
    with pytest.raises(TensorShapeError):
        pool.write(0, [4, 5], torch.full((2, H, D), 7.0).half(), torch.ones(2, H, D + 1).half())
    with pytest.raises(SlotRangeError):
        pool.write(0, [4, 5, 10**6], torch.full((3, H, D), 7.0).half(), good(3))
    assert_unchanged(before, snapshot(pool, handles))


def test_fp8_and_mla_pools_reject_bad_writes_unchanged() -> None:
    pool, handles, _ = make_pool(dtype=torch.float8_e4m3fn)
    before = snapshot(pool, handles)
    with pytest.raises(TensorDtypeError, match="bfloat16"):
        pool.write(0, [4], good(1, torch.float8_e4m3fn), good(1, torch.float8_e4m3fn))
    assert_unchanged(before, snapshot(pool, handles))

    mla = kvpool.KVPool(1, 1, 6, kv_lora_rank=4, qk_rope_head_dim=2, num_slots=8, max_requests=1, max_context_len=4)
    with pytest.raises(TensorShapeError, match="one latent tensor"):
        mla.write(0, [1], torch.ones(1, 1, 6).half(), torch.ones(1, 1, 6).half())
    with pytest.raises(TensorShapeError):
        mla.write(0, [1], torch.ones(1, 1, 5).half())
    assert not mla.k_buffer(0).any()


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_slots=10, page_size=4), "multiple of page_size"),
        (dict(num_slots=16, num_pages=4), "exactly one"),
        (dict(), "exactly one"),
        (dict(num_pages=1), ">= 2 pages"),
        (dict(memory_bytes=100), "budget"),
        (dict(memory_fraction=1.5), r"\(0, 1\]"),
        (dict(num_slots=16, layout="nhd"), "layout"),
        (dict(num_slots=16, dtype=torch.int8), "floating"),
        # Refused before any allocation (they passed a floating-point test, then were refused
        # as "cache has dtype" once the caches existed; at 2**40 slots, an out-of-memory error).
        (dict(num_slots=16, dtype=torch.float64), "dtype must be .* the pool stores"),
        (dict(num_slots=1 << 40, dtype=torch.float8_e4m3fnuz), "dtype must be .* the pool stores"),
        (dict(num_slots=16, kv_lora_rank=4), "both"),
        (dict(num_slots=16, kv_lora_rank=2, qk_rope_head_dim=2), "num_kv_heads=1"),
        (dict(num_slots=16, compute_dtype=torch.float32), "only fp8"),
        (dict(num_slots=16, dtype=torch.float8_e4m3fn, compute_dtype=torch.float8_e4m3fn),
         "compute_dtype must be one of .*, got torch.float8_e4m3fn"),
        # floating, not fp8 a cache stores, and no dtype a read converts to: reads came back
        # wrong (fnuz) or raised an untyped KeyError (e8m0) through the kernels
        *[(dict(num_slots=16, dtype=torch.float8_e4m3fn, compute_dtype=dt), f"compute_dtype must be one of .*, got {dt}")
          for dt in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, *E8M0)],
        (dict(num_slots=16, max_requests=0), "max_requests"),
        (dict(num_slots=16, device="gpu0"), "not a torch device"),
    ],
)
def test_bad_config_raises_invalid_argument(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        kvpool.KVPool(2, H, D, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error only occurs on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_typed_error() -> None:
    with pytest.raises(InvalidArgumentError, match="is_available"):
        kvpool.KVPool(2, H, D, num_slots=16, device="cuda")


# Sizes past any machine's address space, so the allocation fails at once whatever the
# kernel's overcommit policy, and nothing is ever touched.
@pytest.mark.parametrize("case", ["kv", "state"])
def test_a_pool_past_memory_is_a_typed_refusal_naming_what_to_shrink(case):
    if case == "kv":  # 2**52 bytes of K/V
        make = lambda: kvpool.KVPool(1024, 128, 256, num_slots=1 << 24, page_size=16,  # noqa: E731
                                     dtype=torch.float32)
        what, fix = "K/V caches", "num_pages"
    else:  # a 2**50-entry state per slot
        make = lambda: kvpool.KVPool(  # noqa: E731
            2, 2, 8, layer_types=["full_attention", "linear_attention"], num_pages=16, page_size=4,
            state_shapes={"conv": ((1 << 25, 1 << 25), torch.float32)})
        what, fix = "states", "state_shapes"
    with pytest.raises(kvpool.InvalidArgumentError, match=f"cannot allocate .*{what}.*{fix}") as e:
        make()
    assert isinstance(e.value.__cause__, RuntimeError)  # torch's own error, chained


def test_a_host_tier_past_memory_is_a_typed_refusal(monkeypatch):
    # A host tier of that size would need a device pool as large to reach it, so torch's
    # CPU allocator refusal (its very message) is raised for the host buffer alone.
    import kvpool.tiers.host_storage as hs

    real_empty = torch.empty

    def empty(*args, **kwargs):
        if args and isinstance(args[0], tuple) and len(args[0]) == 6:  # the host buffer's shape
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                               "allocate memory: you tried to allocate 1 bytes. Error code 12")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(hs.torch, "empty", empty)
    with pytest.raises(kvpool.InvalidArgumentError, match="cannot allocate the host tier's pages.*host_pages"):
        kvpool.KVPool(2, 2, 8, num_slots=64, page_size=4, host_pages=8)
