"""Outside-style sweep of kvpool.router: inputs a serving router meets that the
other router tests do not cover."""

import pytest

pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool import KVPoolError  # noqa: E402
from kvpool.router import Router  # noqa: E402


def test_loads_may_be_ints_past_floats_range():
    # An int load past float's range (a byte count, a summed token budget) made
    # math.isnan raise OverflowError, an untyped error; ints have no NaN and compare
    # with floats exactly, so it is simply the largest load.
    r = Router(3, page_size=2, hash_seed=1)
    assert r.route([1, 2, 3], loads=[10**400, 5, 10**400]).pool == 1
    assert r.route([1, 2, 3], loads=[10**400, 10**400 - 1, float("inf")]).pool == 1
    assert r.load == [0, 2, 0]
    with pytest.raises(KVPoolError, match=r"loads\[1\] must be a number"):
        r.route([1, 2, 3], loads=[10**400, float("nan"), 0])
    assert r.load == [0, 2, 0], "a refused route counts no request"
