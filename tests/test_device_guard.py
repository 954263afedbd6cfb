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
