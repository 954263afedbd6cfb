"""FileTier driven as an engine that keeps KV across restarts drives it, with arguments it
did not expect: a scan interval past float's range is refused with its typed error."""

from __future__ import annotations

import pytest

import kvpool
from kvpool.tiers import FileTier


@pytest.mark.parametrize("bad", [10 ** 400, -(10 ** 400)], ids=["10**400", "-10**400"])
def test_a_scan_interval_past_float_range_is_a_typed_refusal(tmp_path, bad):
    """10**400 passed the range test (an int compares with inf exactly) and then float() raised
    an untyped OverflowError; nothing is created on a refusal."""
    where = tmp_path / "tier"
    with pytest.raises(kvpool.InvalidArgumentError, match="scan_interval_s"):
        FileTier(where, 1 << 20, scan_interval_s=bad)
    assert not where.exists()
