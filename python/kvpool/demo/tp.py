"""The demo model split by heads for tensor parallelism (Megatron-style), on torch.distributed.

Rank r of t keeps query heads ``[r*H/t, (r+1)*H/t)``, the KV heads those queries
read (its ``KVPool(tp_rank=r, tp_size=t)`` shard), the matching input columns of
``o_proj`` and a slice of the MLP; ``o_proj`` and ``down_proj`` become row-parallel
layers whose partial outputs are summed with one ``all_reduce`` each. Built from
the full model's weights, so the split model computes the same logits.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvpool.demo.model import TinyLM
from kvpool.heads import shard_kv_heads
from kvpool.modes import persistent

__all__ = ["RowParallelLinear", "shard_model"]


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard @ W_shard^T)``: the input-split half of a parallel linear."""

    def __init__(self, weight: torch.Tensor, group: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


def _rows(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    out = nn.Linear(linear.in_features, stop - start, bias=False)
    out.weight = nn.Parameter(linear.weight[start:stop].clone(), requires_grad=False)
    return out.to(linear.weight.device)


def shard_model(model: TinyLM, tp_rank: int, tp_size: int, group: Any = None) -> TinyLM:
    """This rank's shard of ``model`` (embeddings, norms and LM head replicated)."""
    cfg = model.cfg
    first = next(model.layers())
    if cfg.heads % tp_size or first.gate_proj.out_features % tp_size:
        raise ValueError(f"heads ({cfg.heads}) and the MLP width must be divisible by tp_size={tp_size}")
    kv = shard_kv_heads(cfg.kv_heads, tp_rank, tp_size)
    hq, d = cfg.heads // tp_size, cfg.head_dim
    q0 = tp_rank * hq
    if kv.heads * (cfg.heads // cfg.kv_heads) < hq or q0 // (cfg.heads // cfg.kv_heads) < kv.start:
        raise ValueError("each rank's query heads must read only its own KV heads")
    with persistent():
        out = copy.deepcopy(model)
        for block in out.layers():
            ffn = block.gate_proj.out_features // tp_size
            f0 = tp_rank * ffn
            block.q_proj = _rows(block.q_proj, q0 * d, (q0 + hq) * d)
            block.k_proj = _rows(block.k_proj, kv.start * d, (kv.start + kv.heads) * d)
            block.v_proj = _rows(block.v_proj, kv.start * d, (kv.start + kv.heads) * d)
            o = block.o_proj.weight[:, q0 * d : (q0 + hq) * d].clone()
            block.o_proj = RowParallelLinear(o, group)  # a Linear-compatible module
            block.gate_proj = _rows(block.gate_proj, f0, f0 + ffn)
            block.up_proj = _rows(block.up_proj, f0, f0 + ffn)
            block.down_proj = RowParallelLinear(block.down_proj.weight[:, f0:f0 + ffn].clone(), group)
            block.heads, block.kv_heads = hq, kv.heads
    return out
