"""Small torch.distributed helpers shared by the TP check and the request transfer, and the
request transfer's point-to-point link to one peer (``Link``)."""

from __future__ import annotations

import datetime
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvpool.distributed.errors import TransferError, TransferTimeoutError
from kvpool.distributed.protocol import TAG
from kvpool.errors import InvalidArgumentError
from kvpool.validate import is_int

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "Link", "bad_timeout", "check_peer", "comm_device", "wait",
           "group_ranks", "require_group"]

#: Seconds a transfer waits for each message from its peer before giving up.
DEFAULT_TIMEOUT_S = 60.0
#: The longest wait a transfer takes (about 31 years): past it the deadline overflows
#: (datetime.timedelta, then the backend's nanosecond clock), so longer is refused.
MAX_TIMEOUT_S = 1e9


def require_group(group: Any, what: str) -> None:
    """Refuse to run without a process group (torch's own error is an untyped ValueError,
    and a group this rank is not a member of fails deep inside torch)."""
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError(
            f"{what} needs torch.distributed: call torch.distributed.init_process_group(...) on every rank "
            f"first (kvpool has no transport of its own)")
    if group is not None and group is not dist.group.WORLD and group is not dist.GroupMember.NON_GROUP_MEMBER \
            and not isinstance(group, dist.ProcessGroup):
        raise InvalidArgumentError(
            f"{what}: group must be a torch.distributed process group (what dist.new_group returns) or None for "
            f"the world, got {type(group).__name__} {group!r:.60}")
    if group is not None and group is not dist.group.WORLD and dist.get_rank(group) < 0:
        raise InvalidArgumentError(
            f"{what}: this rank ({dist.get_rank()}) is not a member of the process group it was given; pass a "
            f"group that contains it (dist.new_group returns a placeholder to the ranks it leaves out)")


def comm_device(group: Any, pool_device: torch.device, what: str = "kvpool.distributed") -> torch.device:
    """Where tensors for ``group``'s collectives must live: the GPU for NCCL, the host otherwise."""
    require_group(group, what)
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        if pool_device.type != "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return pool_device
    return torch.device("cpu")


def wait(work: Any, timeout_s: float, what: str, peer: int) -> None:
    """Wait for a point-to-point op; a dead or silent peer becomes a typed error, never a hang."""
    # Whole milliseconds, at least one: torch truncates the timeout to milliseconds, and a
    # zero one means "no timeout", so timeout_s=0.0005 waited on a silent peer forever.
    ms = max(1, math.ceil(float(timeout_s) * 1000))
    try:
        ok = work.wait(timeout=datetime.timedelta(milliseconds=ms))
    except RuntimeError as e:
        text = str(e)
        low = text.lower()
        cls = TransferTimeoutError if "timed out" in low or "timeout" in low else TransferError
        raise cls(f"{what} with rank {peer} failed: {text.splitlines()[0][:300]}") from e
    if ok is False:
        raise TransferTimeoutError(f"{what}: rank {peer} did not answer within {timeout_s:g} s")


def group_ranks(group: Any, what: str = "kvpool.distributed") -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    require_group(group, what)
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def check_peer(peer: Any, group: Any, name: str) -> None:
    """Refuse a peer that is not another rank of ``group``: gloo's isend / irecv to a rank
    outside the group wait forever, whatever the timeout, and to this rank fail."""
    if not is_int(peer):
        raise InvalidArgumentError(f"{name} must be an int (a global rank), got {type(peer).__name__} {peer!r}")
    require_group(group, "send_request" if name == "dst_rank" else "recv_request")
    ranks = group_ranks(group)
    if peer not in ranks:
        raise InvalidArgumentError(f"{name}: rank {peer} is not in the group (its ranks are {ranks})")
    if peer == dist.get_rank():
        raise InvalidArgumentError(f"{name}: rank {peer} is this rank; a request moves between two ranks")


def bad_timeout(timeout_s: Any) -> str | None:
    """What is wrong with a transfer's ``timeout_s``, or None."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float, np.integer, np.floating)) or not (
            0 < timeout_s <= MAX_TIMEOUT_S):
        return (f"timeout_s must be a positive number of seconds, at most {MAX_TIMEOUT_S:g} (to wait practically "
                f"forever pass {MAX_TIMEOUT_S:g}), got {timeout_s!r}")
    return None


class Link:
    """Point-to-point messages with one peer, each bounded by the timeout."""

    def __init__(self, peer: int, group: Any, device: torch.device, timeout_s: float) -> None:
        self.peer, self.group, self.device, self.timeout_s = peer, group, device, timeout_s
        self.messages = 0

    def send(self, t: torch.Tensor, what: str) -> Any:
        return self._post(dist.isend, t, f"sending {what} to")

    def post_recv(self, t: torch.Tensor, what: str) -> Any:
        return self._post(dist.irecv, t, f"receiving {what} from")

    def _post(self, op: Any, t: torch.Tensor, doing: str) -> Any:
        self.messages += 1
        try:
            return op(t, self.peer, group=self.group, tag=TAG)
        except RuntimeError as e:
            raise TransferError(f"{doing} rank {self.peer} failed: {str(e)[:300]}") from e

    def wait(self, work: Any, what: str) -> None:
        wait(work, self.timeout_s, what, self.peer)

    def send_ints(self, values: Any, what: str) -> None:
        self.wait(self.send(torch.from_numpy(np.asarray(values, np.int64)).to(self.device), what), what)

    def recv_ints(self, n: int, what: str) -> np.ndarray:
        # Zeroed: gloo completes a receive with a shorter message and leaves the rest of the
        # buffer as it was, so a truncated header or metadata reads as zeros (refused as such),
        # not as whatever memory the buffer reused.
        t = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.wait(self.post_recv(t, what), what)
        return t.cpu().numpy()
