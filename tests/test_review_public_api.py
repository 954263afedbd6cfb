"""What a user gets from ``pip install kvpool``, called the way an outside check calls it:
the public helpers with the user's own inputs, and what their annotations promise.

Each case found a way a public call answered bad input with a bare Python error or,
worse, a plausible wrong answer; the test pins the typed refusal instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool import InvalidArgumentError


def inference_linear() -> torch.nn.Module:
    with torch.inference_mode():
        return torch.nn.Linear(2, 2)


# ----- audit(max_depth=...) ------------------------------------------------------------------

@pytest.mark.parametrize("depth", [-1, -5, None, "3", 1.5, True, np.bool_(True)], ids=repr)
def test_audit_refuses_a_max_depth_that_is_not_a_depth(depth):
    """A negative depth used to return [] for a model full of inference tensors (a false
    "clean"), None or a str raised a bare TypeError from a comparison deep in the walk."""
    with pytest.raises(InvalidArgumentError, match="max_depth"):
        kvpool.audit(inference_linear(), max_depth=depth)


@pytest.mark.parametrize("depth", [0, 4, np.int64(2), 2**40])
def test_audit_still_takes_int_depths(depth):
    findings = kvpool.audit(model=inference_linear(), max_depth=depth)
    assert sorted(f.name for f in findings) == ["model.bias", "model.weight"]
