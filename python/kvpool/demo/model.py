"""A small decoder-only transformer whose attention reads K/V through a kvpool.

The model is deliberately plain (RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, untied LM head) so that an engine developer can see
exactly where the pool enters: each layer computes K/V for the new tokens,
stores them with ``pool.write`` and attends over K/V gathered from the pool's
buffers through ``pool.req_to_token``. ``forward_full`` is the same network
without any cache; the tests compare the two.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
from torch import nn

from kvpool.demo.attention import attend_causal, gather_kv, step_mask


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 1024
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    intermediate: int | None = None  # default: SwiGLU's usual ~8/3 * hidden, rounded to 64
    max_positions: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.vocab_size >= 2, f"vocab_size must be >= 2, got {self.vocab_size}"),
            (self.layers >= 1, f"layers must be >= 1, got {self.layers}"),
            (self.heads >= 1 and self.kv_heads >= 1,
             f"heads and kv_heads must be >= 1, got {self.heads} and {self.kv_heads}"),
            (self.hidden % self.heads == 0,
             f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})"),
            (self.heads % self.kv_heads == 0,
             f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}) "
             "for grouped-query attention"),
            (self.head_dim % 2 == 0,
             f"head_dim (hidden/heads = {self.head_dim}) must be even for rotary embeddings"),
            (self.max_positions >= 1, f"max_positions must be >= 1, got {self.max_positions}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        if self.intermediate is not None:
            return self.intermediate
        return max(64, int(math.ceil(self.hidden * 8 / 3 / 64)) * 64)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "head_dim": self.head_dim, "intermediate": self.ffn}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 so half-precision runs stay stable.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """Rotate-half rotary embeddings from a precomputed cos/sin table."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        # Non-persistent: derived from the config, not part of the weights.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [..., T, H, D]; positions: [..., T] (indexing the table is capture-safe).
        cos = self.cos[positions].unsqueeze(-2)
        sin = self.sin[positions].unsqueeze(-2)
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


class Block(nn.Module):
    layer: int

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary):
        h = self.attn_norm(x)
        lead = h.shape[:-1]
        q = self.q_proj(h).view(*lead, self.heads, self.head_dim)
        k = self.k_proj(h).view(*lead, self.kv_heads, self.head_dim)
        v = self.v_proj(h).view(*lead, self.kv_heads, self.head_dim)
        return rotary(q, positions), rotary(k, positions), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.o_proj(attn.flatten(-2))
        h = self.mlp_norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.max_positions, cfg.rope_theta)

    def layers(self) -> Iterator[Block]:
        return (cast(Block, b) for b in self.blocks)

    # -- reference path: no cache at all -------------------------------------------------
    def forward_full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] for a 1-D token sequence, recomputing everything (the oracle)."""
        positions = torch.arange(tokens.shape[0], device=tokens.device)
        x = self.embed(tokens)
        for block in self.layers():
            q, k, v = block.qkv(x, positions, self.rotary)
            x = block.finish(x, attend_causal(q[None], k[None], v[None], positions[None])[0])
        return self.lm_head(self.norm(x)).float()

    # -- pool path ----------------------------------------------------------------------
    def forward_pool(
        self,
        pool: Any,
        input_ids: torch.Tensor,      # [B, T] new tokens of each request
        positions: torch.Tensor,      # [B, T] their positions
        req_rows: torch.Tensor,       # [B] rows of pool.req_to_token (pool.null_row for padding)
        out_cache_loc: torch.Tensor,  # [B*T] slots the new tokens' K/V go to (0 for padding)
        width: int,                   # how many req_to_token columns to gather (>= longest request)
        last_only: bool = False,      # logits of the last new token only (prefill needs no more)
    ) -> torch.Tensor:
        """Logits [B, T, vocab] ([B, 1, vocab] if last_only); new K/V are stored on the way.

        The caller has already extended each request in the pool, so req_to_token holds
        the slots of every token up to and including the new ones.
        """
        x = self.embed(input_ids)
        # Built once per call, shared by every layer (the gather indices and mask
        # depend on the batch, not on the layer).
        slot_idx = pool.req_to_token[req_rows, :width].long()
        mask = step_mask(positions, self.cfg.heads, width)
        for block in self.layers():
            q, k, v = block.qkv(x, positions, self.rotary)
            pool.write(block.layer, out_cache_loc, k.reshape(-1, *k.shape[-2:]),
                       v.reshape(-1, *v.shape[-2:]))
            keys, values = gather_kv(pool, block.layer, slot_idx)
            x = block.finish(x, attend_causal(q, keys, values, positions, mask))
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x)).float()


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> TinyLM:
    """Random-weight model from ``cfg.seed``, safe to use under any grad mode.

    Built under ``inference_mode(False)`` then ``no_grad()`` (that order: the other one
    turns grad back on), so the weights are normal tensors, never inference tensors,
    even when the caller is inside ``torch.inference_mode()``. Parameters are frozen
    so plain grad mode builds no autograd graph either.
    """
    with torch.inference_mode(False), torch.no_grad():
        gen = torch.Generator().manual_seed(cfg.seed)
        model = TinyLM(cfg)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Norm gains near 1 keep activations well-scaled through the layers.
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
        model.requires_grad_(False)
        model.to(device=device, dtype=dtype)
        # Rotary tables stay float32 whatever the weights' dtype: rebuilt rather than
        # cast back, which would keep the rounding of a half-precision round trip.
        model.rotary = Rotary(cfg.head_dim, cfg.max_positions, cfg.rope_theta).to(device)
        model.eval()
    return model
