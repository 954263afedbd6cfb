"""DecodeGraphRunner.run's inputs: values that do not fit int64 are typed errors (never
a silent wrap to padding), and host inputs are staged through a pinned ring without
waiting for the previous step's copy.

The ring's pinned buffers and CUDA events need a GPU, so here the runner of a CPU pool
is given a PinnedRing with fake events that never complete (a GPU that has run none
of the queued copies): every run must still go through, none may wait. The CUDA path
itself is tested in test_graph_runner_cuda.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_graph_runner import as_tensors, decode_inputs, make_pool, snapshot, start_requests

import kvpool
from kvpool.cuda_graph import INPUT_NAMES, DecodeGraphRunner
from kvpool.staging import PinnedRing
from kvpool.testing.toy_step import ToyDecode

U64_MAX = 2**64 - 1


def _runner(pool=None):
    pool = pool or make_pool()
    return pool, DecodeGraphRunner(pool, ToyDecode(pool), max_batch_size=4)


def _args(pool, **override):
    args = {"input_ids": [1, 2], "positions": [0, 1], "req_rows": [0, 1],
            "out_cache_loc": [pool.page_size + 1, pool.page_size + 2], "seq_lens": [1, 2]}
    args.update(override)
    return [args[name] for name in INPUT_NAMES]


# (what out_cache_loc is given as, the value that does not fit int64)
HUGE_SLOTS = [
    ("list", [5, U64_MAX], U64_MAX),
    ("list-2**63", [5, 2**63], 2**63),
    ("list-past-u64", [5, 2**64], 2**64),
    ("list-mixed-sign", [-1, 2**63], 2**63),  # numpy would make this float64
    ("numpy-uint64", np.array([5, U64_MAX], dtype=np.uint64), U64_MAX),
    ("torch-uint64", torch.tensor([5, U64_MAX], dtype=torch.uint64), U64_MAX),
]


@pytest.mark.parametrize("kind,slots,value", HUGE_SLOTS, ids=[k for k, _, _ in HUGE_SLOTS])
def test_out_cache_loc_past_int64_is_a_slot_range_error(kind, slots, value):
    """2**64 - 1 would wrap to -1 (padding: the write silently skipped); 2**63 raised
    an untyped TypeError. Both are SlotRangeError, as KVPool.write says for them."""
    pool, runner = _runner()
    before = snapshot(pool)
    static = runner._static.clone()
    with pytest.raises(kvpool.SlotRangeError, match=rf"out_cache_loc\[1\] = {value} is out of range"):
        runner.run(*_args(pool, out_cache_loc=slots))
    # KVPool.write refuses the same slots (a uint64 tensor by its dtype).
    with pytest.raises(kvpool.TensorDtypeError if kind == "torch-uint64" else kvpool.SlotRangeError):
        pool.write(0, slots, torch.zeros((2, 2, 8)), torch.zeros((2, 2, 8)))
    assert torch.equal(runner._static, static)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(pool), before))


def test_out_cache_loc_past_the_pool_is_a_slot_range_error():
    pool, runner = _runner()
    with pytest.raises(kvpool.SlotRangeError, match=rf"out_cache_loc\[0\] = {pool.num_slots} is out of range: "
                                                    rf"valid slots are \[0, {pool.num_slots}\)"):
        runner.run(*_args(pool, out_cache_loc=[pool.num_slots, 3]))


@pytest.mark.parametrize("name", [n for n in INPUT_NAMES if n != "out_cache_loc"])
@pytest.mark.parametrize("value", [U64_MAX, 2**63, -(2**63) - 1])
def test_other_inputs_past_int64_are_invalid_argument_errors(name, value):
    pool, runner = _runner()
    for given in ([0, value], np.array([0, value], dtype=np.uint64) if value > 0 else None):
        if given is None:
            continue
        with pytest.raises(kvpool.InvalidArgumentError, match=rf"{name}\[1\] = {value} does not fit in int64") as e:
            runner.run(*_args(pool, **{name: given}))
        assert not isinstance(e.value, kvpool.SlotRangeError)


def test_int64_extremes_and_padding_still_pass():
    """Values that fit int64 are taken as they are: -1 is padding (skipped), and the
    int64 minimum is a negative (padding) slot too."""
    pool, runner = _runner()
    before = snapshot(pool)
    runner.run(*_args(pool, out_cache_loc=np.array([-1, -(2**63)], dtype=np.int64)))
    assert runner._static[INPUT_NAMES.index("out_cache_loc"), :2].tolist() == [-1, -(2**63)]
    assert all(torch.equal(a, b) for a, b in zip(snapshot(pool), before))


def test_errors_name_the_bad_input():
    pool, runner = _runner()
    with pytest.raises(kvpool.TensorDtypeError, match="seq_lens must be integers"):
        runner.run(*_args(pool, seq_lens=np.array([1.0, 2.0])))
    with pytest.raises(kvpool.TensorDtypeError, match="positions must be integers"):
        runner.run(*_args(pool, positions=[True, False]))
    with pytest.raises(kvpool.TensorShapeError, match="req_rows must be 1-D"):
        runner.run(*_args(pool, req_rows=np.zeros((2, 1), dtype=np.int64)))
    with pytest.raises(kvpool.TensorDtypeError, match="input_ids must be a 1-D sequence of integers"):
        runner.run(*_args(pool, input_ids=[[1], [2, 3]]))
    assert runner.run(*_args(pool)).shape == (2, 64)  # still usable


def _bad_values(ctx):
    return [("input_ids", [1, -1], "token ids are >= 0"),
            ("positions", [0, ctx], rf"valid positions are \[0, {ctx - 1}\]"),
            ("positions", [-1, 1], rf"valid positions are \[0, {ctx - 1}\]"),
            ("seq_lens", [1, ctx + 1], rf"valid seq_lens are \[0, {ctx}\]"),
            ("seq_lens", [1, -2], rf"valid seq_lens are \[0, {ctx}\]")]


def test_host_values_the_step_would_index_with_are_checked():
    """A negative token id, or a position or length past the pool's rows, would make the
    step read outside its tables (on a GPU a device-side assert that ends the CUDA
    context): refused before any buffer changes, naming the entry and the valid range."""
    pool, runner = _runner()
    ctx = pool.max_context_len
    before, static = snapshot(pool), runner._static.clone()
    for name, values, valid in _bad_values(ctx):
        bad = next(i for i, v in enumerate(values) if v < 0 or v >= ctx)
        for given in (values, np.array(values), torch.tensor(values)):
            with pytest.raises(kvpool.InvalidArgumentError, match=rf"{name}\[{bad}\] = {values[bad]} is out of range: "
                                                               rf"{valid}"):
                runner.run(*_args(pool, **{name: given}))
    assert torch.equal(runner._static, static)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(pool), before))
    # The ends of each range pass.
    out = runner.run(*_args(pool, input_ids=[0, 5], positions=[0, ctx - 1], seq_lens=[0, ctx]))
    assert out.shape[0] == 2


# ----- staging through the pinned ring ----------------------------------------------------

class NeverDone:
    """A CUDA event for a GPU that has run nothing yet."""

    waits = 0

    def record(self, stream=None):
        pass

    def query(self):
        return False

    def synchronize(self):
        NeverDone.waits += 1


def test_host_inputs_go_through_the_ring_without_waiting(monkeypatch):
    """Three steps in a row while no copy has completed: each is one packed transfer
    through the ring ([5, bucket], real rows then padding), the ring grows to three
    buffers, and nothing waits. Results equal the same steps run on a twin."""
    NeverDone.waits = 0
    pool, twin = make_pool(), make_pool()
    runner = DecodeGraphRunner(pool, ToyDecode(pool), max_batch_size=8)
    ring = PinnedRing(torch.device("cpu"), alloc=lambda n: torch.empty(n, dtype=torch.uint8),
                      make_event=NeverDone)
    sent = []

    def to_device(host):
        sent.append(host.copy())
        return ring.to_device(host)

    runner._to_device = to_device
    hs, th = start_requests(pool, [2, 3, 4]), start_requests(twin, [2, 3, 4])
    for step in range(3):
        args, targs = decode_inputs(pool, hs, seed=step), decode_inputs(twin, th, seed=step)
        got = runner.run(*args)
        want = ToyDecode(twin)(*as_tensors(targs))
        torch.testing.assert_close(got, want[:3], rtol=1e-5, atol=1e-5)
        packed = sent[-1]
        assert packed.shape == (5, 4) and packed.dtype == np.int64  # bucket 4 for 3 requests
        for i, a in enumerate(args):
            assert packed[i, :3].tolist() == np.asarray(a).tolist()
        assert packed[:, 3].tolist() == list(runner._pad_vals)
    assert len(sent) == 3 and ring.depth == 3 and NeverDone.waits == 0
    sink = pool.page_size  # page 0 takes the padded entries' K/V on the runner's side only
    for a, b in zip(snapshot(pool), snapshot(twin)):
        torch.testing.assert_close(a.reshape(-1, 2, 8)[sink:], b.reshape(-1, 2, 8)[sink:], rtol=1e-5, atol=1e-5)


def test_cpu_pool_writes_inputs_directly():
    """A CPU pool has no ring: nothing to stage, the buffers are written in place."""
    pool, runner = _runner()
    assert runner._to_device is None
    runner.run(*_args(pool))
    assert runner._static[:, :2].tolist() == [list(map(int, x)) for x in _args(pool)]


@pytest.mark.parametrize("n,bucket", [(3, 4), (4, 4), (1, 8)])
@pytest.mark.parametrize("mixed", [None, torch.int32, torch.uint32])
def test_device_inputs_load_as_one_stack_and_one_pad(n, bucket, mixed):
    """Device inputs (every input a tensor: what check_inputs passes on for a CUDA pool) are
    loaded by one stack into the static rows and one copy of the padding (uint32 ones by a copy
    each). Driven here with CPU tensors straight into _load_inputs: the rows hold the inputs,
    and the padding each input's own pad value, over whatever the last step left."""
    pool = make_pool()
    runner = DecodeGraphRunner(pool, ToyDecode(pool), max_batch_size=8, enable_graphs=False)
    runner._static.fill_(-7)  # a previous step's leftovers
    args = [torch.arange(n, dtype=torch.int64) + 10 * (i + 1) for i in range(len(INPUT_NAMES))]
    if mixed is not None:  # (torch does not promote uint32: such inputs take a copy each)
        args[1], args[4] = args[1].to(mixed), args[4].to(mixed)
    runner._load_inputs(args, n, bucket)
    static = runner._static
    for i, a in enumerate(args):
        assert static[i, :n].tolist() == a.tolist()
        assert static[i, n:bucket].tolist() == [runner._pad_vals[i]] * (bucket - n)
    assert (static[:, bucket:] == -7).all()  # past the bucket: untouched


@pytest.mark.parametrize("name", INPUT_NAMES)
@pytest.mark.parametrize("flag", [True, np.bool_(True)], ids=["bool", "numpy-bool"])
def test_a_bool_inside_a_list_input_is_refused_as_write_refuses_it(name, flag):
    """numpy makes [0, True] an int array, and True would name row (or slot) 1: the step then
    writes another request's K/V. KVPool.write refuses such a slot list; so does run()."""
    pool, runner = _runner()
    before = snapshot(pool)
    args = _args(pool)
    i = INPUT_NAMES.index(name)
    args[i] = [args[i][0], flag]
    with pytest.raises(kvpool.TensorDtypeError, match=rf"{name}\[1\] is the bool"):
        runner.run(*args)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool)))


@pytest.mark.parametrize("name", INPUT_NAMES)
def test_a_reversed_numpy_input_is_taken_as_write_takes_it(name):
    """A valid int64 array with a negative stride (``a[::-1]``): torch.from_numpy refused it with
    an untyped ValueError after the earlier inputs were loaded. KVPool.write takes such slots."""
    pool, runner = _runner()
    args = _args(pool)
    i = INPUT_NAMES.index(name)
    args[i] = np.ascontiguousarray(np.asarray(args[i], dtype=np.int64)[::-1])[::-1]
    assert args[i].strides[0] < 0
    runner.run(*args)
    assert runner._static[:, :2].tolist() == [list(map(int, x)) for x in _args(pool)]


# torch.int4 is 2.5+ (pyproject's floor is 2.4)
@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8, torch.qint32, torch.bits8, torch.uint1,
                                   *[getattr(torch, n) for n in ("int4",) if hasattr(torch, n)]])
@pytest.mark.parametrize("name", ["out_cache_loc", "positions"])
def test_a_tensor_of_a_non_integer_dtype_is_a_dtype_error(dtype, name):
    """Quantized and bits dtypes are not integers: Tensor.numpy() refused them with an untyped
    TypeError; KVPool.write refuses them with TensorDtypeError, and so does run(), first."""
    pool, runner = _runner()
    before, static = snapshot(pool), runner._static.clone()
    args = _args(pool)
    i = INPUT_NAMES.index(name)
    if dtype in (torch.qint8, torch.quint8, torch.qint32):
        args[i] = torch._make_per_tensor_quantized_tensor(torch.tensor(args[i], dtype=torch.int8).to(
            {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.qint32: torch.int32}[dtype]), 1.0, 0)
    else:
        args[i] = torch.empty(2, dtype=dtype)
    with pytest.raises(kvpool.TensorDtypeError, match=f"{name} must be integers, got {dtype}"):
        runner.run(*args)
    assert torch.equal(runner._static, static) and all(torch.equal(a, b) for a, b in zip(before, snapshot(pool)))


@pytest.mark.parametrize("device_load", [False, True], ids=["host-rows", "device-stack"])
def test_inputs_that_are_the_runners_own_buffers_load_as_they_were(device_load):
    """An engine passing back, as another input, a view the step was handed (positions given
    as last step's input_ids view): the load wrote the rows in turn and read that input after
    its row was overwritten, so the step ran on wrong values without an error."""
    pool = make_pool()
    handed = []
    runner = DecodeGraphRunner(pool, lambda *a: handed.append(a) or a[0].clone(), max_batch_size=4,
                               enable_graphs=False)
    runner.run(*_args(pool))
    ids = handed[-1][0][:2]
    args = [torch.tensor([7, 7]), ids, *[torch.as_tensor(a) for a in _args(pool)[2:]]]
    want = [a.tolist() for a in args]
    if device_load:  # (the one-stack load device inputs take, driven with CPU tensors)
        runner._load_inputs(args, 2, 4)
    else:
        runner.run(*args)
    assert runner._static[:, :2].tolist() == want
