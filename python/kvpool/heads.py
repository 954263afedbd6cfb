"""Which KV heads a tensor-parallel rank holds: pure arithmetic, beside ``layout``,
so a pool sizes its shard without loading ``kvpool.distributed``."""

from __future__ import annotations

from typing import NamedTuple

from kvpool._core import InvalidArgumentError
from kvpool.validate import check_flag, is_int

__all__ = ["HeadShard", "shard_kv_heads"]


class HeadShard(NamedTuple):
    """KV heads ``[start, start + heads)`` of ``total`` live on this rank."""

    start: int
    heads: int
    total: int


def shard_kv_heads(num_kv_heads: int, tp_rank: int, tp_size: int, *, mla: bool = False) -> HeadShard:
    """The KV heads rank ``tp_rank`` of ``tp_size`` holds.

    ``tp_size`` divides ``num_kv_heads``: each rank holds ``num_kv_heads / tp_size``
    consecutive heads (Megatron's column split of the K/V projections).
    ``num_kv_heads`` divides ``tp_size`` (more ranks than KV heads, common with
    GQA): each rank holds one head, replicated on ``tp_size / num_kv_heads``
    ranks, as vLLM and SGLang do. MLA pools replicate the latent cache on every
    rank (``mla=True``). Anything else raises ``InvalidArgumentError``.
    """
    for name, value, low in (("tp_size", tp_size, 1), ("tp_rank", tp_rank, 0), ("num_kv_heads", num_kv_heads, 1)):
        if not is_int(value) or value < low:
            raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
    num_kv_heads, tp_rank, tp_size = int(num_kv_heads), int(tp_rank), int(tp_size)
    mla = check_flag("mla", mla)
    if tp_rank >= tp_size:
        raise InvalidArgumentError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
    if mla or tp_size == 1:
        return HeadShard(0, num_kv_heads, num_kv_heads)
    if num_kv_heads % tp_size == 0:
        per = num_kv_heads // tp_size
        return HeadShard(tp_rank * per, per, num_kv_heads)
    if tp_size % num_kv_heads == 0:
        return HeadShard(tp_rank // (tp_size // num_kv_heads), 1, num_kv_heads)
    raise InvalidArgumentError(
        f"num_kv_heads={num_kv_heads} cannot be split over tp_size={tp_size}: one must divide the other "
        f"(each rank holds num_kv_heads/tp_size heads, or one head replicated on tp_size/num_kv_heads ranks)"
    )
