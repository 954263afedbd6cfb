"""recv_request against a broken or hostile sender (two gloo processes).

Every header field is checked against the receiving pool's own geometry before
anything is allocated or opened: each bad field gives a typed error on the
receiver, the sender gets a refusal at once (not at its timeout), both pools
are unchanged, no staging is allocated, and the channel still carries a real
transfer afterwards. Staging above ``KEEP_STAGING_BYTES`` is freed after its
transfer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvpool.distributed import protocol as P

sys.path.insert(0, str(Path(__file__).parent))
import _dist  # noqa: E402
import _dist_hostile as H  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

# A refusal is prompt when it comes well before the peers' timeout.
PROMPT_S = H.PEER_TIMEOUT_S / 2


@pytest.fixture(scope="module")
def hostile_run():
    return _dist.run_ranks(H.hostile, world=2, timeout_s=240)


@pytest.mark.parametrize("name", list(H.CASES))
def test_each_bad_header_is_refused_promptly_and_changes_nothing(hostile_run, name):
    sender, receiver = hostile_run
    _fields, _meta, status, text = H.CASES[name]
    got_status, seconds = sender[name]
    assert got_status == status, f"{name}: the sender was told {P.REASONS.get(got_status, got_status)}"
    assert seconds < PROMPT_S, f"{name}: the refusal took {seconds:.1f} s"
    err = receiver[name]
    assert err is not None, f"{name}: the receiver accepted it"
    if status == P.CONTEXT:
        assert err["error"] == "ContextTooLongError"
    else:
        assert (err["error"], err["reason"]) == ("TransferRejectedError", P.REASONS[status])
    assert text in err["message"], err["message"]
    assert err["seconds"] < PROMPT_S
    assert err["unchanged"], f"{name}: the receiving pool changed"
    assert not err["staging"], f"{name}: staging was allocated for a refused transfer"


@pytest.mark.parametrize("name", ["fp8_scale_nan", "fp8_scale_0"])
def test_fp8_scales_must_be_finite_and_positive(hostile_run, name):
    sender, receiver = hostile_run
    assert sender[name][0] == P.MALFORMED and sender[name][1] < PROMPT_S
    err = receiver[name]
    assert err["reason"] == "malformed" and "finite and positive" in err["message"] and err["unchanged"]


def test_real_sender_of_another_version_is_refused_at_once(hostile_run):
    sender, receiver = hostile_run
    reason, message, seconds = sender["real_sender_refused"]
    assert reason == "malformed" and "malformed" in message and seconds < PROMPT_S
    assert receiver["real_sender_refused"] == ("malformed", True)


def test_channel_still_works_and_big_staging_is_freed(hostile_run):
    sender, receiver = hostile_run
    for got in receiver["received"]:
        for (k, v), (k0, v0) in zip(got, sender["sent"]):
            assert torch.equal(k, k0) and torch.equal(v, v0)
    # Small staging stays with the pool for the next transfer; above the limit it is freed.
    assert receiver["staging_kept"] == [True, False]
