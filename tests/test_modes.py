"""persistent(), audit() and mutable(): the grad-mode helpers users apply to their own tensors."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import torch

import kvpool
from kvpool.modes import ERR_INPLACE_INFERENCE, ERR_LEAF_REQUIRES_GRAD, ERR_SAVED_FOR_BACKWARD, ERR_VERSION_COUNTER


class ToyModel(torch.nn.Module):
    """A model whose rotary cache is built the way SGLang once built it: inside inference_mode."""

    cos_cache: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        with torch.inference_mode():
            self.register_buffer("cos_cache", torch.ones(8, 4))
        self.register_buffer("ok_buffer", torch.zeros(3))


def modes() -> tuple[bool, bool]:
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


@pytest.mark.parametrize("outer", ["default", "no_grad", "inference_mode", "both"])
def test_persistent_makes_normal_grad_free_tensors_and_restores_modes(outer: str) -> None:
    options: dict[str, list[Any]] = {
        "default": [],
        "no_grad": [torch.no_grad()],
        "inference_mode": [torch.inference_mode()],
        "both": [torch.no_grad(), torch.inference_mode()],
    }
    ctx = options[outer]
    for c in ctx:
        c.__enter__()
    try:
        before = modes()
        with kvpool.persistent():
            assert modes() == (False, False)
            t = torch.zeros(4)
            w = torch.ones(4, requires_grad=True)
            y = w * 2  # grad recording must be off even though w requires grad
        assert modes() == before
        assert not t.is_inference() and not t.requires_grad
        assert not y.requires_grad
        t.add_(1)  # in-place outside inference mode works
        assert t._version >= 1
    finally:
        for c in reversed(ctx):
            c.__exit__(None, None, None)


def test_reverse_nesting_reenables_grad_which_persistent_avoids() -> None:
    # The trap persistent() exists for: no_grad first, then inference_mode(False).
    with torch.inference_mode():
        with torch.no_grad(), torch.inference_mode(False):
            assert torch.is_grad_enabled()
        with kvpool.persistent():
            assert not torch.is_grad_enabled()


def test_persistent_is_thread_local() -> None:
    seen = []
    with torch.inference_mode():
        with kvpool.persistent():
            t = threading.Thread(target=lambda: seen.append(modes()))
            t.start()
            t.join()
        assert torch.is_inference_mode_enabled()
    assert seen == [(True, False)]  # a new thread starts in plain grad mode


def test_audit_names_the_inference_buffer_and_predicts_the_error() -> None:
    model = ToyModel()
    findings = kvpool.audit(model)
    assert [f.name for f in findings] == ["ToyModel.cos_cache"]
    (f,) = findings
    assert f.kind == "inference tensor"
    assert f.error == ERR_INPLACE_INFERENCE
    assert f.version_error == ERR_VERSION_COUNTER
    assert f.autograd_error == ERR_SAVED_FOR_BACKWARD
    assert f.shape == (8, 4) and f.dtype == torch.float32
    assert "cos_cache" in str(f)

    # The predicted errors are exactly what torch raises.
    with torch.no_grad(), pytest.raises(RuntimeError, match=re.escape(f.error)):
        model.cos_cache.mul_(2)
    # ...and it raises *after* writing: the data has already changed.
    assert torch.equal(model.cos_cache, torch.full((8, 4), 2.0))
    assert f.version_error is not None and f.autograd_error is not None
    with pytest.raises(RuntimeError, match=re.escape(f.version_error)):
        _ = model.cos_cache._version
    x = torch.ones(8, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=re.escape(f.autograd_error)):
        (x * model.cos_cache).sum().backward()

    # After mutable() the same write works, in every mode, and audit is clean.
    assert kvpool.mutable(model) is model
    assert kvpool.audit(model) == []
    with torch.no_grad():
        model.cos_cache.mul_(2)
    model.cos_cache.add_(1)
    assert torch.equal(model.cos_cache, torch.full((8, 4), 5.0))


def test_audit_keyword_names_nested_containers_and_plain_attributes() -> None:
    with torch.inference_mode():
        inf = torch.zeros(2)
    grad_buf = torch.zeros(3, requires_grad=True)

    class Runner:
        def __init__(self) -> None:
            self.static = {"positions": inf, "fine": torch.zeros(1)}
            self.graphs = [torch.zeros(1), grad_buf]

    model = torch.nn.Linear(2, 2)
    model.rope = inf  # a plain tensor attribute, not a registered buffer
    with torch.inference_mode():
        model.caches = [torch.zeros(1), torch.zeros(1)]  # tensors in a plain list attribute
    found = {(f.name, f.kind) for f in kvpool.audit(runner=Runner(), model=model)}
    assert ("runner.static['positions']", "inference tensor") in found
    assert ("runner.graphs[1]", "requires grad") in found
    assert ("model.caches[1]", "inference tensor") in found
    # `inf` is reported once even though it is reachable twice.
    assert sum(1 for name, _ in found if "positions" in name or name.endswith("rope")) == 1
    # Parameters requiring grad are normal model state, not findings.
    assert not any("weight" in name or "bias" in name for name, _ in found)


def test_requires_grad_finding_predicts_the_leaf_error() -> None:
    buf = torch.zeros(3, requires_grad=True)
    (f,) = kvpool.audit(buf)
    assert (f.name, f.kind, f.error) == ("tensor0", "requires grad", ERR_LEAF_REQUIRES_GRAD)
    with pytest.raises(RuntimeError, match=re.escape(f.error)):
        buf.add_(1)


def test_audit_of_a_pool_built_in_inference_mode_is_clean() -> None:
    with torch.inference_mode():
        pool = kvpool.KVPool(2, 1, 4, num_slots=16, max_requests=2, max_context_len=8)
    assert kvpool.audit(pool) == []
    # The walk does see the pool's tensors: break one on purpose.
    with torch.inference_mode():
        pool.req_to_token = torch.zeros(3, 8, dtype=torch.int32)
    assert [f.name for f in kvpool.audit(pool)] == ["KVPool.req_to_token"]


@pytest.mark.parametrize("outer", ["default", "inference_mode"])
def test_mutable_copies_tensor_and_parameter(outer: str) -> None:
    with torch.inference_mode():
        t = torch.arange(4.0)
        p = torch.nn.Parameter(torch.ones(2))
    ctx = torch.inference_mode() if outer == "inference_mode" else torch.enable_grad()
    with ctx:
        before = modes()
        m = kvpool.mutable(t)
        mp = kvpool.mutable(p)
        assert modes() == before
    assert not m.is_inference() and not m.requires_grad and torch.equal(m, t)
    assert m.data_ptr() != t.data_ptr()
    assert isinstance(mp, torch.nn.Parameter) and mp.requires_grad and not mp.is_inference()
    m.add_(1)
    assert torch.equal(t, torch.arange(4.0))  # a copy: the original is untouched


def test_mutable_rejects_other_types() -> None:
    # docs/errors.md: every kvpool refusal is a KVPoolError (this was a bare TypeError)
    with pytest.raises(kvpool.InvalidArgumentError, match="torch.Tensor or nn.Module"):
        kvpool.mutable([1, 2])


def test_module_built_in_inference_mode_is_fixed_by_mutable() -> None:
    with torch.inference_mode():
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    names = {f.name for f in kvpool.audit(model=model)}
    assert names == {"model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"}
    kvpool.mutable(model)
    assert kvpool.audit(model=model) == []
    for p in model.parameters():
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad
    with torch.no_grad():
        model[0].weight.zero_()  # type: ignore[operator]  # raises on an inference tensor
    assert not model[0].weight.any()  # type: ignore[operator]
