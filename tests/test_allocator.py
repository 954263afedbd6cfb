"""SlotAllocator bindings: API behaviour and argument conversion."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import kvpool
from kvpool import InvalidArgumentError, SlotAllocator


def test_fresh_pool_order_page0_reserved_and_properties():
    a = SlotAllocator(9, page_size=4, max_requests=3, max_context_len=32)
    assert (a.num_pages, a.page_size, a.num_slots) == (9, 4, 36)
    assert (a.capacity_pages, a.capacity_slots, a.free_pages, a.used_pages) == (8, 32, 8, 0)
    h = a.open(2)
    assert h.dtype == np.int64 and h.shape == (2,)
    assert [kvpool.handle_row(x) for x in h] == [0, 1]
    slots = a.extend(h, [5, 1])
    assert slots.dtype == np.int64
    assert slots.tolist() == [4, 5, 6, 7, 8, 12]  # page 0 (slots 0..3) never handed out
    assert (a.used_pages, a.free_pages, a.free_slots, a.used_slots) == (3, 5, 20, 12)
    assert (a.open_requests, a.admissible_tokens) == (2, 20)
    assert a.metadata_bytes > 0
    a.check()


def test_lazy_metadata_behaves_alike_and_leaves_the_index_slab_to_grow():
    """lazy_metadata=True (a pool sized far beyond its use) changes when metadata is mapped,
    never what a call returns: the same calls give the same slots and hits. The default
    reserves the index's entry slab for every page at the first cache() (64 bytes a page);
    a lazy pool's slab holds what was registered."""
    seen = []
    for lazy in (False, True):
        a = SlotAllocator(1 << 18, 1, 8, 512, hash_seed=3, handle_seed=4, lazy_metadata=lazy)
        h, hit = a.open_with_prefix(np.arange(300), [300])
        slots = a.extend(h, 300)
        a.close(h, cache=True)
        h2, hit2 = a.open_with_prefix(np.arange(300), [300])
        seen.append((hit.tolist(), slots.tolist(), hit2.tolist(), a.slots(h2[0]).tolist(), a.metadata_bytes))
        a.check()
    (*eager, eager_bytes), (*lazy, lazy_bytes) = seen
    assert eager == lazy and lazy[2] == [299]
    assert eager_bytes - lazy_bytes >= 60 * (1 << 18) - 64 * 300


def test_queries_and_page_table():
    a = SlotAllocator(32, page_size=4, max_requests=4, max_context_len=64)
    h = a.open(3)
    a.extend(h, np.array([5, 0, 8]))
    assert a.lengths(h).tolist() == [5, 0, 8]
    assert a.length(h[0]) == 5 and isinstance(a.length(h[0]), int)
    assert a.slots(h[0]).tolist() == [4, 5, 6, 7, 8]
    assert a.pages(h[2]).dtype == np.int32 and a.pages(h[2]).tolist() == [3, 4]
    indptr, indices, last = a.page_table(h)
    assert [x.dtype for x in (indptr, indices, last)] == [np.int32] * 3
    assert indptr.tolist() == [0, 2, 2, 4]
    assert indices.tolist() == [1, 2, 3, 4]
    assert last.tolist() == [1, 0, 4]
    assert a.rows(h).tolist() == [0, 1, 2]
    assert a.is_open(h[1]) and not a.is_open(12345)


def test_extend_with_starts_truncate_close_reuse_lifo():
    a = SlotAllocator(64, page_size=1, max_requests=4, max_context_len=64)
    h = a.open(2)
    slots, starts = a.extend_with_starts(h, [3, 2])
    assert starts.tolist() == [0, 0] and slots.tolist() == [1, 2, 3, 4, 5]
    slots, starts = a.extend_with_starts(h, 1)
    assert starts.tolist() == [3, 2] and slots.tolist() == [6, 7]
    a.truncate(h, [1, 2])  # frees 2, 3, 6 (request 0), then 7 (request 1)
    assert a.lengths(h).tolist() == [1, 2]
    # LIFO: the page freed last (7) comes back first, then request 0's in their old order.
    assert a.extend(h[:1], 4).tolist() == [7, 2, 3, 6]
    a.close(h)
    assert a.open_requests == 0 and a.free_pages == 63
    h2 = a.open(1)
    assert kvpool.handle_row(h2[0]) == 1 and h2[0] != h[1]  # last closed row first, new generation
    a.reset()
    assert a.open_requests == 0 and not a.is_open(h2[0])
    a.check()


class _TensorSubclass(torch.Tensor):
    pass


COUNT_FORMS = {
    "list": lambda v: v,
    "tuple": tuple,
    "i64": lambda v: np.array(v, dtype=np.int64),
    "i32": lambda v: np.array(v, dtype=np.int32),
    "u16": lambda v: np.array(v, dtype=np.uint16),
    "i8": lambda v: np.array(v, dtype=np.int8),
    "i16": lambda v: np.array(v, dtype=np.int16),
    "u8": lambda v: np.array(v, dtype=np.uint8),
    "u32": lambda v: np.array(v, dtype=np.uint32),
    "be-i8": lambda v: np.array(v, dtype=">i8"),  # non-native byte order
    "strided": lambda v: np.repeat(np.array(v, dtype=np.int64), 2)[::2],  # non-contiguous
    "strided-i32": lambda v: np.repeat(np.array(v, dtype=np.int32), 3)[::3],
    "reversed-i32": lambda v: np.array(v[::-1], dtype=np.int32)[::-1],  # negative stride
    "torch-i64": torch.tensor,
    "torch-i32": lambda v: torch.tensor(v, dtype=torch.int32),
    "torch-i16": lambda v: torch.tensor(v, dtype=torch.int16),
    "torch-u8": lambda v: torch.tensor(v, dtype=torch.uint8),
    "torch-offset": lambda v: torch.tensor([7, 7, *v])[2:],  # a view with a storage offset
    "torch-strided": lambda v: torch.tensor(v).repeat_interleave(2)[::2],  # non-contiguous
    "torch-subclass": lambda v: torch.tensor(v).as_subclass(_TensorSubclass),
    "misaligned": lambda v: misaligned_int64(v),
}
# Handles need 64 bits, so only the int64-capable forms apply to them.
HANDLE_FORMS = ["list", "tuple", "i64", "be-i8", "strided", "torch-i64", "torch-offset", "torch-strided",
                "torch-subclass", "misaligned"]


def misaligned_int64(v):
    """An int64 view starting one byte into a buffer (numpy flags it unaligned)."""
    raw = np.zeros(len(v) * 8 + 1, dtype=np.uint8)
    a = raw[1:].view(np.int64)
    a[:] = v
    assert not a.flags.aligned
    return a


@pytest.mark.parametrize("form", COUNT_FORMS)
def test_counts_and_lengths_accept_ints_lists_arrays_tensors(form):
    make = COUNT_FORMS[form]
    a = SlotAllocator(64, max_requests=4, max_context_len=64)
    h = a.open(3)
    assert a.extend(h, make([2, 0, 3])).tolist() == [1, 2, 3, 4, 5]
    a.truncate(h, make([1, 0, 1]))
    assert a.lengths(h).tolist() == [1, 0, 1]
    a.check()


@pytest.mark.parametrize("form", HANDLE_FORMS)
def test_handles_accept_lists_arrays_tensors(form):
    a = SlotAllocator(64, max_requests=4, max_context_len=64)
    h = COUNT_FORMS[form](a.open(3).tolist())
    assert a.extend(h, [1, 2, 0]).tolist() == [1, 2, 3]
    assert a.lengths(h).tolist() == [1, 2, 0]
    assert a.rows(h).tolist() == [0, 1, 2]
    a.truncate(h, 0)
    a.close(h)
    assert a.open_requests == 0 and a.free_pages == 63


@pytest.mark.parametrize("form", [f for f in COUNT_FORMS if f != "i8"])
def test_prompt_tokens_read_the_same_from_every_integer_form(form):
    # Each form is read (in place where it can be) into the same token ids:
    # the cached prompt is found again only if every id came through intact.
    a = SlotAllocator(64, 4, max_requests=4, max_context_len=64, hash_seed=2)
    prompt = [3, 200, 17, 255, 0, 9, 128, 64, 1, 250, 33]
    h, cached = a.open_with_prefix(np.array(prompt), [11])
    a.extend(h, 11)
    a.close(h, cache=True)
    h, cached = a.open_with_prefix(COUNT_FORMS[form](prompt), [11])
    assert cached.tolist() == [8]
    assert a.extend(h, 3, tokens=COUNT_FORMS[form](prompt[8:])).size == 3  # agrees with the prompt
    a.close(h, cache=True)
    changed = prompt[:5] + [6] + prompt[6:]
    h, cached = a.open_with_prefix(COUNT_FORMS[form](changed), [11])
    assert cached.tolist() == [4]
    a.check()


def test_list_elements_of_every_kind_are_read_or_named():
    # Plain ints are read straight from the list; everything else takes the
    # checked path: numpy ints and int subclasses are ints, bools and values
    # past int64 are refused by name, and an __index__ that empties the list
    # while it is read cannot make the reader run past its end.
    import enum

    class Three(enum.IntEnum):
        X = 3

    a = SlotAllocator(64, max_requests=4, max_context_len=64)
    h = a.open(3)
    assert a.extend(h, [1, np.int32(2), Three.X]).tolist() == list(range(1, 7))
    assert a.extend(h, (1, np.int64(1), 0)).tolist() == [7, 8]  # tuples are read the same way
    before = a.lengths(h).tolist()
    for seq in (list, tuple):
        with pytest.raises(InvalidArgumentError, match="bool"):
            a.extend(h, seq([1, True, 1]))
    for past in (2**63, -(2**63) - 1, 2**64):
        for seq in (list, tuple):
            with pytest.raises(InvalidArgumentError, match="int64 range"):
                a.extend(h, seq([1, past, 1]))
    with pytest.raises(InvalidArgumentError, match="negative"):
        a.extend(h, [1, -1, 1])  # a plain -1 is read as -1, not as an error marker
    with pytest.raises(InvalidArgumentError, match="float"):
        a.extend(h, [1, 1.0, 1])

    counts = [1, 1, 1, 1, 1]

    class Shrinks:
        def __index__(self):
            del counts[1:]
            return 1

    counts[0] = Shrinks()
    with pytest.raises(InvalidArgumentError):  # one count for three handles
        a.extend(h, counts)
    assert a.lengths(h).tolist() == before
    a.check()


def pool_of_one_token_requests(n):
    """A small pool with n open requests of one token each, and their lengths
    (what a refused call must leave as they were)."""
    a = SlotAllocator(64, max_requests=4, max_context_len=64)
    h = a.open(n)
    a.extend(h, 1)
    return a, h, a.lengths(h).tolist()


def test_torch_tensors_that_are_not_plain_int_vectors_are_refused_by_name():
    # CPU int tensors are read in place; the rest keeps numpy's verdict.
    a, h, before = pool_of_one_token_requests(3)
    cases = [
        (torch._neg_view(torch.tensor([1, 1, 1])), "negative bit"),  # stored unnegated
        (torch.tensor([1.0, 1.0, 1.0]), "integer dtype"),
        (torch.tensor([True, True, True]), "integer dtype"),
        (torch.ones(3, 1, dtype=torch.int64), "2-D"),
    ]
    for bad, match in cases:
        with pytest.raises(InvalidArgumentError, match=match):
            a.extend(h, bad)
    assert a.lengths(h).tolist() == before
    got = a.extend(h, torch.tensor(2))  # a 0-d tensor is one count for all
    assert got.tolist() == [s for x in h for s in a.slots(x)[-2:].tolist()]
    assert a.extend(torch.zeros(0, dtype=torch.int64), 5).tolist() == []  # an empty batch
    a.check()


def test_a_broadcast_argument_too_big_to_copy_is_a_memory_error_not_an_abort():
    # A stride-0 view claims 2**40 items over one: copying it out must fail
    # as a MemoryError (a failed Rust allocation would abort the process),
    # with nothing changed. The same for a torch expand (read through numpy).
    a, h, before = pool_of_one_token_requests(2)
    huge = [np.broadcast_to(np.array(1, dtype=dt), (2**40,)) for dt in (np.int64, np.int32, np.uint8)]
    huge.append(torch.ones(1, dtype=torch.int32).expand(2**40))
    for arg in huge:
        with pytest.raises(MemoryError, match="cannot allocate"):
            a.extend(h, arg)
        with pytest.raises(MemoryError):
            a.extend(arg, 1)
    assert a.lengths(h).tolist() == before
    a.check()


def test_only_torch_s_own_tensor_type_is_read_through_its_data_pointer():
    # A class that calls itself torch.Tensor and lies about its memory must
    # not be trusted with a data pointer: it takes the numpy path, which
    # refuses it. Run in a fresh process, so that it is the first
    # "tensor" the bindings see (no real one cached before it).
    code = textwrap.dedent(
        """
        import numpy as np, torch, kvpool
        buf = np.array([3, 3, 3], dtype=np.int64)

        class Tensor:
            is_cpu = True
            dtype = torch.int64
            def dim(self): return 1
            def is_contiguous(self): return True
            def is_neg(self): return False
            def numel(self): return 3
            def data_ptr(self): return buf.ctypes.data
        Tensor.__module__ = "torch"

        a = kvpool.SlotAllocator(64, max_requests=4, max_context_len=64)
        h = a.open(3)
        try:
            a.extend(h, Tensor())
            print("read")
        except kvpool.InvalidArgumentError:
            print("refused")
        print(a.lengths(h).tolist(), a.extend(h, torch.tensor([1, 2, 1])).tolist())
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["refused", "[0, 0, 0]" + " [1, 2, 3, 4]"]


def test_scalars_numpy_scalars_and_zero_d():
    a = SlotAllocator(64, max_requests=4, max_context_len=64)
    h = a.open(1)
    assert a.extend(int(h[0]), 2).tolist() == [1, 2]  # Python int handle
    assert a.extend(h[0], np.int32(1)).tolist() == [3]  # numpy scalars
    assert a.extend(h, np.array(1)).tolist() == [4]  # 0-d array broadcasts
    assert a.length(torch.tensor(int(h[0]))) == 4
    assert a.extend(np.array([], np.int64), 5).tolist() == []  # empty batch is fine


def test_table_argument_writes_rows_in_place():
    a = SlotAllocator(64, page_size=2, max_requests=3, max_context_len=8)
    table_t = torch.zeros(4, 8, dtype=torch.int32)  # a CPU req_to_token with a spare null row
    table = table_t.numpy()
    h = a.open(2)
    s = a.extend(h, [3, 1], table=table)
    s2 = a.extend(h, [1, 2], table=table)
    assert table_t[0, :4].tolist() == a.slots(h[0]).tolist() == [s[0], s[1], s[2], s2[0]]
    assert table_t[1, :3].tolist() == a.slots(h[1]).tolist()
    assert int(table_t[2:].abs().sum()) == 0 and int(table_t[0, 4:].abs().sum()) == 0


def test_repr_mentions_configuration():
    r = repr(SlotAllocator(10, page_size=2, max_requests=3, max_context_len=7))
    assert "SlotAllocator(num_pages=10, page_size=2, max_requests=3, max_context_len=7" in r


def test_exception_hierarchy():
    for name in [
        "PoolExhaustedError",
        "InvalidHandleError",
        "TooManyRequestsError",
        "ContextTooLongError",
        "InvalidArgumentError",
        "InvariantError",
    ]:
        cls = getattr(kvpool, name)
        assert issubclass(cls, kvpool.KVPoolError) and cls is getattr(kvpool._core, name)
    assert issubclass(kvpool.KVPoolError, Exception)
    assert issubclass(InvalidArgumentError, ValueError)
    assert not issubclass(kvpool.PoolExhaustedError, ValueError)


def test_construction_arguments_are_validated():
    for kwargs in [
        dict(num_pages=0),
        dict(num_pages=8, page_size=0),
        dict(num_pages=8, max_requests=0),
        dict(num_pages=8, max_context_len=-1),
        dict(num_pages=2**31),
    ]:
        with pytest.raises(InvalidArgumentError):
            SlotAllocator(**kwargs)


def test_handle_seed_makes_handles_agree():
    """Same handle_seed + same calls -> same handles (TP ranks); unseeded pools differ."""
    def run(**kw):
        a = SlotAllocator(16, 2, 4, 32, **kw)
        h = a.open(3)
        a.extend(h, [3, 1, 2])
        a.close(h[:1])
        return np.concatenate([h, a.open(1)]), a
    (h1, _), (h2, _) = run(handle_seed=11), run(handle_seed=11)
    assert h1.tolist() == h2.tolist()
    h3, a3 = run(handle_seed=12)
    assert h3.tolist() != h1.tolist() and (h3 & 0xFFFFFFFF).tolist() == (h1 & 0xFFFFFFFF).tolist()
    assert not any(a3.is_open(int(h)) for h in h1), "another seed's handles are not valid here"
    assert run()[0].tolist() != run()[0].tolist()  # random bases: equal with p ~ 2^-31
    p1, p2 = (kvpool.KVPool(1, 1, 4, num_pages=8, handle_seed=7) for _ in range(2))
    assert p1.open(2).tolist() == p2.open(2).tolist()
    for bad in [True, -1, 2**64, 1.5, "7"]:
        with pytest.raises(InvalidArgumentError, match="handle_seed"):
            SlotAllocator(8, handle_seed=bad)


def test_allocator_is_weak_referenceable():
    import gc
    import weakref

    a = SlotAllocator(4)
    ref = weakref.ref(a)
    assert ref() is a
    del a
    gc.collect()
    assert ref() is None


def test_stats_snapshot_matches_properties():
    a = kvpool.SlotAllocator(10, 4, 3, 64)
    h = a.open(2)
    a.extend(h, [5, 2])
    s = a.stats()
    names = ["free_pages", "used_pages", "free_slots", "used_slots", "open_requests", "admissible_tokens",
             "metadata_bytes"]
    assert {n: getattr(s, n) for n in names} == {n: getattr(a, n) for n in names}
    assert (s.free_pages, s.used_pages, s.used_slots, s.open_requests) == (6, 3, 12, 2)
    assert "free_pages=6" in repr(s)
    # Geometry is fixed at construction and read without the lock.
    assert (a.page_size, a.num_pages, a.num_slots, a.max_requests, a.max_context_len,
            a.capacity_pages, a.capacity_slots) == (4, 10, 40, 3, 64, 9, 36)
    with pytest.raises(AttributeError):
        a.page_size = 8  # type: ignore[misc]
