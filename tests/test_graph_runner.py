"""DecodeGraphRunner on CPU (eager path): padding, results, grad modes, errors.

The CUDA capture/replay path is tested in test_graph_runner_cuda.py (skips
without a GPU) and benchmarks/gpu_check.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool.cuda_graph import DecodeGraphRunner, default_buckets, grad_mode
from kvpool.testing.toy_step import ToyDecode

MODES = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": torch.enable_grad,
}


def make_pool(layout="token", page_size=2, device="cpu", dtype=torch.float32, seed=0):
    pool = kvpool.KVPool(2, 2, 8, dtype=dtype, device=device, num_pages=48, page_size=page_size,
                         max_requests=8, max_context_len=16, layout=layout)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # garbage everywhere, so any stray write shows
        for bufs in (pool.k_buffers, pool.v_buffers):
            for t in bufs:
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return pool


def start_requests(pool, lens):
    handles = pool.open(len(lens))
    pool.extend(handles, np.asarray(lens, dtype=np.int64))
    return handles


def decode_inputs(pool, handles, seed=1):
    res = pool.extend(handles, 1)
    lens = pool.allocator.lengths(handles)
    gen = np.random.default_rng(seed)
    ids = gen.integers(0, 64, size=len(handles))
    return (ids, lens - 1, pool.rows(handles), res.slots, lens)


def snapshot(pool):
    return [t.clone() for t in pool.k_buffers + pool.v_buffers]


def as_tensors(inputs, device="cpu"):
    return tuple(torch.as_tensor(np.asarray(a, dtype=np.int64), device=device) for a in inputs)


@pytest.mark.parametrize("layout,page_size", [("token", 1), ("token", 4), ("paged", 4)])
@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_eager_runner_matches_direct_step(layout, page_size, n):
    lens = [2 + (3 * i) % 7 for i in range(n)]
    pools = [make_pool(layout, page_size) for _ in range(2)]
    handles = [start_requests(p, lens) for p in pools]
    inputs = [decode_inputs(p, h) for p, h in zip(pools, handles)]
    assert all(np.array_equal(a, b) for a, b in zip(*inputs))
    before = snapshot(pools[0])

    runner = DecodeGraphRunner(pools[0], ToyDecode(pools[0]), max_batch_size=8)
    with torch.inference_mode():
        got = runner.run(*inputs[0])
        want = ToyDecode(pools[1])(*as_tensors(inputs[1]))
    assert got.shape == want.shape == (n, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    page0 = set(range(page_size))
    written = set(int(s) for s in inputs[0][3])
    for t_run, t_ref, t_before in zip(snapshot(pools[0]), snapshot(pools[1]), before):
        rows_run, rows_ref, rows_before = (x.reshape(-1, 2, 8) for x in (t_run, t_ref, t_before))
        for s in range(rows_run.shape[0]):
            if s in page0:
                continue  # the padding sink: padded tokens may land here
            if s in written:
                torch.testing.assert_close(rows_run[s], rows_ref[s], rtol=1e-5, atol=1e-5)
                assert not torch.equal(rows_run[s], rows_before[s])
            else:
                assert torch.equal(rows_run[s], rows_before[s]), f"slot {s} changed"


def test_padding_values_seen_by_step():
    pool = make_pool()
    seen = {}

    def step(*args):
        seen.update(zip(("ids", "pos", "rows", "loc", "lens"), (a.clone() for a in args)))
        return torch.zeros((args[0].shape[0], 3))

    runner = DecodeGraphRunner(pool, step, max_batch_size=16, pad_seq_len=1)
    out = runner.run([5, 6, 7], [1, 2, 3], [0, 1, 2], [10, 11, 12], [2, 3, 4])
    assert out.shape == (3, 3)
    assert seen["ids"].tolist() == [5, 6, 7, 0]  # padded to bucket 4
    assert seen["pos"].tolist() == [1, 2, 3, 0]
    assert seen["rows"].tolist() == [0, 1, 2, pool.null_row]
    assert seen["loc"].tolist() == [10, 11, 12, 0]  # slot 0: page 0, the padding sink
    assert seen["lens"].tolist() == [2, 3, 4, 1]
    assert pool.req_to_token[pool.null_row].eq(0).all()
    runner.run(torch.tensor([1] * 9), torch.zeros(9, dtype=torch.int32), np.zeros(9, dtype=np.int16), [1] * 9, [1] * 9)
    assert len(seen["ids"]) == 16


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(9) == [1, 2, 4, 8, 16]
    assert default_buckets(20) == [1, 2, 4, 8, 16, 24]
    assert default_buckets(256)[-3:] == [240, 248, 256]
    assert all(b % 8 == 0 for b in default_buckets(256)[3:])


@pytest.mark.parametrize("mode", list(MODES))
def test_runs_in_callers_grad_mode(mode):
    pool = make_pool()
    handles = start_requests(pool, [3, 4])
    inputs = decode_inputs(pool, handles)
    modes_seen = []

    def step(*args):
        modes_seen.append(grad_mode())
        return ToyDecode(pool)(*args)

    runner = DecodeGraphRunner(pool, step, max_batch_size=4)
    assert not runner._static.is_inference() and not runner._static.requires_grad
    with MODES[mode]():
        out = runner.run(*inputs)
    assert modes_seen == [mode]
    assert out.is_inference() == (mode == "inference_mode")
    assert not any(t.is_inference() for t in pool.k_buffers)


def test_static_buffers_normal_when_built_in_inference_mode():
    pool = make_pool()
    with torch.inference_mode():
        runner = DecodeGraphRunner(pool, ToyDecode(pool), max_batch_size=4)
    assert not runner._static.is_inference()
    with torch.no_grad():  # in-place writes outside inference mode must work
        runner.run([1], [0], [pool.null_row], [0], [1])


def test_graphs_disabled_equals_enabled_on_cpu():
    pool_a, pool_b = make_pool(), make_pool()
    ha, hb = start_requests(pool_a, [2, 5, 1]), start_requests(pool_b, [2, 5, 1])
    ia, ib = decode_inputs(pool_a, ha), decode_inputs(pool_b, hb)
    ra = DecodeGraphRunner(pool_a, ToyDecode(pool_a), 8, enable_graphs=True, debug=True)
    rb = DecodeGraphRunner(pool_b, ToyDecode(pool_b), 8, enable_graphs=False)
    assert not ra.use_graphs and ra.captured == []
    ra.capture()  # no-op on CPU
    with torch.no_grad():
        assert torch.equal(ra.run(*ia), rb.run(*ib))
    assert all(torch.equal(x, y) for x, y in zip(snapshot(pool_a), snapshot(pool_b)))


def test_tuple_outputs_are_sliced():
    pool = make_pool()
    runner = DecodeGraphRunner(pool, lambda *a: (a[0] * 2, [a[4]]), max_batch_size=8)
    out = runner.run([1, 2, 3], [0, 0, 0], [0, 1, 2], [5, 6, 7], [1, 1, 1])
    assert out[0].tolist() == [2, 4, 6] and out[1][0].tolist() == [1, 1, 1]


def test_errors_leave_runner_usable():
    pool = make_pool()
    runner = DecodeGraphRunner(pool, lambda *a: a[0].clone(), max_batch_size=4)
    with pytest.raises(kvpool.InvalidArgumentError, match="exceeds max_batch_size 4"):
        runner.run([1] * 5, [0] * 5, [0] * 5, [0] * 5, [1] * 5)
    with pytest.raises(kvpool.TensorShapeError, match="equal lengths"):
        runner.run([1, 2], [0], [0, 0], [0, 0], [1, 1])
    with pytest.raises(kvpool.InvalidArgumentError, match="empty batch"):
        runner.run([], [], [], [], [])
    with pytest.raises(kvpool.TensorShapeError, match="1-D"):
        runner.run(torch.zeros((1, 1), dtype=torch.int64), [0], [0], [0], [1])
    with pytest.raises(kvpool.TensorDtypeError, match="must be integers"):
        runner.run(torch.zeros(1), [0], [0], [0], [1])
    with pytest.raises(kvpool.TensorDtypeError, match="must be integers"):
        runner.run([1], [0], [0.5], [0], [1])
    assert runner.run([7], [0], [0], [0], [1]).tolist() == [7]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_batch_size=0), "max_batch_size must be a positive int"),
        (dict(max_batch_size=16, buckets=[1, 8]), "largest bucket 8 < max_batch_size 16"),
        (dict(max_batch_size=4, buckets=[0, 4]), "buckets must be positive"),
        (dict(max_batch_size=4, pad_seq_len=-1), "pad_seq_len"),
        (dict(max_batch_size=4, buckets=["a", 4]), "buckets must be positive ints"),
        (dict(max_batch_size=4, buckets=[2.5, 4]), "buckets must be positive ints"),
        (dict(max_batch_size=4, buckets=[True, 4]), "buckets must be positive ints"),
        (dict(max_batch_size=4, buckets=4), "buckets must be positive ints"),
        (dict(max_batch_size=4, pad_seq_len="1"), "pad_seq_len must be an int >= 0"),
        (dict(max_batch_size=4, pad_seq_len=1.5), "pad_seq_len must be an int >= 0"),
        (dict(max_batch_size=4, pad_seq_len=None), "pad_seq_len must be an int >= 0"),
        (dict(max_batch_size=4, warmup_iters="2"), "warmup_iters must be an int >= 1"),
        (dict(max_batch_size=4, warmup_iters=1.5), "warmup_iters must be an int >= 1"),
        (dict(max_batch_size=4, warmup_iters=0), "warmup_iters must be an int >= 1"),
        # make_pool's max_context_len is 16: a padded row of length 17 would read past its row
        (dict(max_batch_size=4, pad_seq_len=17), "past the pool's max_context_len 16"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(kvpool.InvalidArgumentError, match=match):
        DecodeGraphRunner(make_pool(), lambda *a: None, **kwargs)


def test_custom_buckets_pick_smallest_fit():
    runner = DecodeGraphRunner(make_pool(), lambda *a: a[0].clone(), max_batch_size=10, buckets=[10, 3])
    assert runner.buckets == [3, 10]
    assert [runner.bucket_for(n) for n in (1, 3, 4, 10)] == [3, 3, 10, 10]


class _StaticOutputStep:
    """A step whose output lives in one buffer it owns, as a captured graph's output does:
    every call overwrites it. Shows what the runner hands back in each output mode."""

    def __init__(self, width):
        with kvpool.modes.persistent():
            self.buf = torch.zeros((width, 3))

    def __call__(self, input_ids, positions, req_rows, out_cache_loc, seq_lens):
        b = input_ids.shape[0]
        self.buf[:b] = input_ids[:, None].float()
        return self.buf[:b]


@pytest.mark.parametrize("copy_outputs", [False, True])
def test_outputs_valid_until_next_run_unless_copied(copy_outputs):
    pool = make_pool()
    step = _StaticOutputStep(8)
    runner = DecodeGraphRunner(pool, step, 8, buckets=[2, 8], copy_outputs=copy_outputs)
    row = pool.null_row
    with torch.inference_mode():
        small = runner.run([5], [0], [row], [0], [1])        # bucket 2
        assert small.tolist() == [[5.0] * 3]                   # valid right after run()
        big = runner.run([7] * 6, [0] * 6, [row] * 6, [0] * 6, [1] * 6)  # bucket 8
    assert big.tolist() == [[7.0] * 3] * 6
    shares = small.untyped_storage().data_ptr() == step.buf.untyped_storage().data_ptr()
    if copy_outputs:
        assert not shares and small.tolist() == [[5.0] * 3]   # kept across other buckets' runs
        assert small.is_inference()                            # made in the caller's mode
    else:
        # The documented contract: a view of memory the next run() (any bucket) reuses.
        assert shares and small.tolist() == [[7.0] * 3]


def test_copy_outputs_copies_every_tensor_of_a_tuple():
    pool = make_pool()

    def step(*args):
        return (args[0].float(), [args[1].float() + 1])

    runner = DecodeGraphRunner(pool, step, 4, copy_outputs=True)
    with torch.no_grad():
        a, (b,) = runner.run([3, 4], [0, 1], [pool.null_row] * 2, [0, 0], [1, 1])
    statics = runner._static.untyped_storage().data_ptr()
    assert a.tolist() == [3.0, 4.0] and b.tolist() == [1.0, 2.0]
    assert a.untyped_storage().data_ptr() != statics and b.untyped_storage().data_ptr() != statics


def test_run_and_capture_happen_on_the_pools_device(monkeypatch):
    """Every run() (copies, step, replay) is inside on_device(pool.device), so a pool on
    cuda:1 never launches on the current cuda:0 (the guard itself: test_device_guard.py)."""
    import contextlib

    import kvpool.cuda_graph as cg

    entered, inside = [], []

    @contextlib.contextmanager
    def guard(dev):
        entered.append(dev)
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    monkeypatch.setattr(cg, "on_device", guard)
    pool = make_pool()

    def step(*args):
        assert inside, "step ran outside the device guard"
        return args[0].float()

    runner = DecodeGraphRunner(pool, step, 4)
    with torch.no_grad():
        runner.run([1, 2], [0, 0], [pool.null_row] * 2, [0, 0], [1, 1])
    assert entered == [pool.device]


def test_capture_records_on_a_stream_of_the_pools_device(monkeypatch):
    """torch.cuda.graph without stream= captures on one process-wide stream, made on the
    device current at the process's first capture: a runner for a pool on cuda:1 in a
    process that captured on cuda:0 first would record its step into a cuda:0 graph. The
    runner passes a stream of its own device. CUDA is faked: streams remember their device,
    and the fake graph() keeps torch's process-wide default, made on cuda:0."""
    import contextlib

    current = []  # the stream a torch.cuda.stream() context made current

    class FakeStream:
        def __init__(self, device=None, priority=0):
            self.device = torch.device("cuda", 0) if device is None else torch.device(device)

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def use(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    default = FakeStream()  # torch.cuda.graph.default_capture_stream, made under cuda:0
    captured = []

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None):
        with use(stream if stream is not None else default):
            yield

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(device))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)

    pool = make_pool()

    def step(*args):
        captured.append(current[-1].device if current else None)
        return args[0].float()

    runner = DecodeGraphRunner(pool, step, 4, warmup_iters=1)
    runner.use_graphs, runner.device = True, torch.device("cuda", 1)  # as a pool on cuda:1
    with torch.no_grad():
        runner._capture(grad_mode(), 2)
    # Warm-up, then the capture itself: both on a stream of cuda:1.
    assert captured == [torch.device("cuda", 1)] * 2
    assert runner.captured == [("no_grad", 2)]


def test_pad_seq_len_up_to_max_context_len_is_what_padded_rows_carry():
    seen = []
    runner = DecodeGraphRunner(make_pool(), lambda *a: seen.append(a[4].tolist()) or a[0].clone(),
                               max_batch_size=4, pad_seq_len=16)
    runner.run([1, 2, 3], [0, 0, 0], [0, 1, 2], [4, 5, 6], [1, 1, 1])
    assert seen[-1] == [1, 1, 1, 16]


def test_a_dataclass_output_is_cut_to_the_real_batch_as_a_dict_is():
    import dataclasses

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        hidden: tuple
        note: str = "kept"

    step = lambda ids, *a: Out(ids.float()[:, None], (ids.float(),))  # noqa: E731
    for copy in (False, True):
        out = DecodeGraphRunner(make_pool(), step, max_batch_size=8, copy_outputs=copy).run(
            [1, 2, 3], [0, 0, 0], [0, 1, 2], [4, 5, 6], [1, 1, 1])
        assert type(out) is Out and out.logits.flatten().tolist() == [1.0, 2.0, 3.0]
        assert out.hidden[0].tolist() == [1.0, 2.0, 3.0] and out.note == "kept"


def test_a_0d_output_is_a_typed_error_naming_the_padded_rows():
    runner = DecodeGraphRunner(make_pool(), lambda ids, *a: (ids.float(), ids.float().sum()), max_batch_size=8)
    with pytest.raises(kvpool.InvalidArgumentError, match="0-d tensor"):
        runner.run([1, 2, 3], [0, 0, 0], [0, 1, 2], [4, 5, 6], [1, 1, 1])


def test_a_hybrid_pool_is_refused_before_anything_is_built():
    # A hybrid pool's step has one out_cache_loc per layer group; the runner stages and checks one,
    # so it would range-check nothing (no num_slots) and hand the step one group's slots.
    hybrid = kvpool.KVPool(2, 2, 8, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                           dtype=torch.float32, page_size=4, num_pages=16, max_requests=4, max_context_len=32)
    with pytest.raises(kvpool.InvalidArgumentError, match="one out_cache_loc per layer group"):
        DecodeGraphRunner(hybrid, lambda *a: None, max_batch_size=4)
