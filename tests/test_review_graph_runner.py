"""DecodeGraphRunner's lazy capture (the first run() of a bucket with no graph yet), driven on
CPU with CUDA faked: a fake graph's replay() runs the step again on the tensors it was captured
with, as a real replay re-runs the recorded kernels on the same buffers. The real CUDA path is
tested in test_graph_runner_cuda.py (skips without a GPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kvpool
from kvpool.cuda_graph import DecodeGraphRunner


class _FakeStream:
    def __init__(self, device=None, priority=0):
        pass

    def wait_stream(self, other):
        pass


class _FakeGraph:
    def __init__(self):
        self.replay_step = None

    def replay(self):
        self.replay_step()


@pytest.fixture
def fake_cuda(monkeypatch):
    """Fakes the CUDA calls the runner's capture makes; returns the list the step appends its
    inputs' values to (one entry per call: warm-up, capture, and every replay)."""
    calls = []

    def step(*args):
        calls.append(([a.tolist() for a in args], args))
        return args[0].float()

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None):
        first = len(calls)
        yield
        captured = calls[first][1]  # the static views the capture ran the step on
        cuda_graph.replay_step = lambda: step(*captured)

    @contextlib.contextmanager
    def use(stream):
        yield

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return step, calls


def _runner(step, **kw):
    pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_slots=64, page_size=1, max_requests=4,
                         max_context_len=16)
    runner = DecodeGraphRunner(pool, step, 4, buckets=[2, 4], warmup_iters=1, **kw)
    runner.use_graphs = True  # as on a CUDA pool: the faked capture and replay
    return pool, runner


@pytest.mark.parametrize("as_input", [0, 1, 4])
def test_a_buffer_view_passed_to_a_bucket_not_captured_yet_is_loaded_as_it_was(fake_cuda, as_input):
    """A view the step was handed, passed back to run() as an input (documented as fine): when
    run() had to capture the bucket first, the capture reset the static buffers to pad values,
    and the inputs were loaded again from the caller's tensors, so that view now read padding and
    the step replayed on it (input_ids [0, 0] for [1, 2]) without an error."""
    step, calls = fake_cuda
    _, runner = _runner(step)
    with torch.no_grad():
        runner.capture([4])
        views = calls[-1][1]
        runner.run([5, 6, 7], [1, 2, 3], [0, 1, 2], [9, 10, 11], [2, 3, 4])
        assert calls[-1][0][1] == [1, 2, 3, 0]  # replayed on the loaded buffers
        args = [[3, 4], [1, 2], [0, 1], [9, 10], [2, 3]]
        want = [list(a) for a in args]
        want[as_input] = calls[-1][0][1][:2]
        args[as_input] = views[1][:2]  # bucket 4's positions row: [1, 2]
        runner.run(*args)  # bucket 2 has no graph yet: captured here, then replayed
    assert runner.captured == [("no_grad", 2), ("no_grad", 4)]
    assert calls[-1][0] == want


def test_debug_check_still_sees_a_moved_buffer_after_a_later_capture(fake_cuda):
    """debug=True checks the captured addresses before each replay; a later capture (a lazy one
    for another bucket) recorded the addresses of that moment, so a buffer that moved between
    the captures went unnoticed by the replays of every earlier graph."""
    step, _ = fake_cuda
    pool, runner = _runner(step, debug=True)
    inputs = ([1], [0], [0], [3], [1])
    with torch.no_grad():
        runner.run(*inputs)  # bucket 2 captured
        pool.req_to_token = pool.req_to_token.clone()  # what the check exists for: a moved table
        with pytest.raises(kvpool.InvariantError, match="moved"):
            runner.run(*(x * 3 for x in inputs))  # bucket 4: would capture on the new address
        with pytest.raises(kvpool.InvariantError, match="moved"):
            runner.run(*inputs)  # bucket 2's graph still reads the old table
    assert runner.captured == [("no_grad", 2)]


@pytest.mark.parametrize("empty", [[], (), range(0)])
def test_capture_of_an_empty_bucket_list_captures_nothing(fake_cuda, empty):
    """capture(None) captures every bucket; an empty list (an engine's filtered list) asked for
    none, and used to capture them all (their graphs and memory)."""
    step, _ = fake_cuda
    _, runner = _runner(step)
    with torch.no_grad():
        runner.capture(empty)
        assert runner.captured == []
        runner.capture()
    assert runner.captured == [("no_grad", 2), ("no_grad", 4)]
