"""Small torch.distributed helpers shared by the TP check and the request transfer."""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvpool.distributed.errors import TransferError, TransferTimeoutError
from kvpool.errors import InvalidArgumentError
from kvpool.validate import is_int

__all__ = ["DEFAULT_TIMEOUT_S", "bad_timeout", "check_peer", "comm_device", "wait", "group_ranks"]

#: Seconds a transfer waits for each message from its peer before giving up.
DEFAULT_TIMEOUT_S = 60.0


def comm_device(group: Any, pool_device: torch.device) -> torch.device:
    """Where tensors for ``group``'s collectives must live: the GPU for NCCL, the host otherwise."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        if pool_device.type != "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return pool_device
    return torch.device("cpu")


def wait(work: Any, timeout_s: float, what: str, peer: int) -> None:
    """Wait for a point-to-point op; a dead or silent peer becomes a typed error, never a hang."""
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        text = str(e)
        low = text.lower()
        cls = TransferTimeoutError if "timed out" in low or "timeout" in low else TransferError
        raise cls(f"{what} with rank {peer} failed: {text.splitlines()[0][:300]}") from e
    if ok is False:
        raise TransferTimeoutError(f"{what}: rank {peer} did not answer within {timeout_s:g} s")


def group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def check_peer(peer: Any, group: Any, name: str) -> None:
    """Refuse a peer that is not another rank of ``group``: gloo's isend / irecv to a rank
    outside the group wait forever, whatever the timeout, and to this rank fail."""
    if not is_int(peer):
        raise InvalidArgumentError(f"{name} must be an int (a global rank), got {type(peer).__name__} {peer!r}")
    if group is None and not dist.is_initialized():
        return  # (no group to check against: the transfer's first message says so)
    ranks = group_ranks(group)
    if peer not in ranks:
        raise InvalidArgumentError(f"{name}: rank {peer} is not in the group (its ranks are {ranks})")
    if peer == dist.get_rank():
        raise InvalidArgumentError(f"{name}: rank {peer} is this rank; a request moves between two ranks")


def bad_timeout(timeout_s: Any) -> str | None:
    """What is wrong with a transfer's ``timeout_s``, or None."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float, np.integer, np.floating)) or not (
            timeout_s > 0):
        return f"timeout_s must be a positive number of seconds, got {timeout_s!r}"
    return None
