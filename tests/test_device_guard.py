"""Launches run on their tensors' device (kernels/_guard.py). Two CUDA devices are
mocked: torch.cuda.current_device / torch.cuda.device are replaced by a fake that
tracks which device is current."""

from __future__ import annotations

import pytest
import torch

from kvpool.kernels import _guard


class FakeCuda:
    def __init__(self, current=0):
        self.current, self.switches = current, []

    def current_device(self):
        return self.current

    def device(self, index):
        fake = self

        class Ctx:
            def __enter__(self):
                self.prev, fake.current = fake.current, index
                fake.switches.append(index)

            def __exit__(self, *exc):
                fake.current = self.prev

        return Ctx()


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    return fake


def test_switches_to_another_device_and_back(cuda):
    with _guard.on_device(torch.device("cuda", 1)):
        assert cuda.current == 1
    assert cuda.current == 0 and cuda.switches == [1]


def test_no_switch_when_current_or_not_cuda(cuda):
    for dev in (torch.device("cuda", 0), torch.device("cpu"), torch.device("cuda")):
        with _guard.on_device(dev):
            assert cuda.current == 0
    assert cuda.switches == []


def test_every_kernel_launch_runs_inside_the_guard_of_its_tensors_device(monkeypatch):
    """Wiring: each of the four kernel functions launches inside on_device(<its tensors'
    device>). The launches are replaced by recorders and the Triton branch forced."""
    import contextlib

    import kvpool.kernels as K
    from kvpool.kernels import _common, copy, gather, ops, req_table, store, table_ops

    stack, launched = [], []

    @contextlib.contextmanager
    def guard(dev):
        stack.append(dev)
        try:
            yield
        finally:
            stack.pop()

    def recorder(name):
        def launch(*args, **kwargs):
            launched.append((name, list(stack)))
        return launch

    monkeypatch.setattr(ops, "on_device", guard)
    monkeypatch.setattr(table_ops, "on_device", guard)  # (the table write lives there)
    monkeypatch.setattr(_common, "use_triton", lambda t: True)
    for mod, fn in ((store, "launch_store_kv"), (gather, "launch_gather_kv"),
                    (copy, "launch_copy_slots"), (req_table, "launch_write_req_to_token")):
        monkeypatch.setattr(mod, fn, recorder(fn))
    cache = torch.zeros((16, 2, 8))
    idx = torch.tensor([1, 2])
    K.store_kv(cache, cache.clone(), idx, torch.ones(2, 2, 8), torch.ones(2, 2, 8))
    K.gather_kv(cache, None, idx)
    K.copy_slots([cache], idx, idx + 4)
    K.write_req_to_token(torch.zeros((2, 8), dtype=torch.int32), idx[:1], idx[:1], idx[:1], idx)
    cpu = torch.device("cpu")
    assert launched == [("launch_store_kv", [cpu]), ("launch_gather_kv", [cpu]),
                        ("launch_copy_slots", [cpu]), ("launch_write_req_to_token", [cpu])]
