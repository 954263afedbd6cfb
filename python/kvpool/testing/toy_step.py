"""A tiny decode step that behaves like a real one towards the pool: per layer it
writes each token's K/V through ``pool.write`` at ``out_cache_loc`` and attends
over its request's tokens found through ``pool.req_to_token[req_rows]`` up to
``seq_lens``. Device ops only (no host reads), so it is capturable in a CUDA
graph. Shared by the runner tests and benchmarks/gpu_check.py."""

from __future__ import annotations

import math

import torch

from kvpool.modes import persistent


class ToyDecode:
    def __init__(self, pool, vocab: int = 64, seed: int = 0) -> None:
        self.pool = pool
        self.h, self.d = pool.num_kv_heads, pool.head_dim
        dtype = getattr(pool, "compute_dtype", pool.dtype)
        gen = torch.Generator().manual_seed(seed)
        with persistent():  # weights are long-lived: normal, grad-free tensors
            self.emb = (torch.randn(vocab, self.h * self.d, generator=gen) * 0.5).to(pool.device, dtype)
            self.ctx = torch.arange(pool.max_context_len, device=pool.device)

    def kv(self, x: torch.Tensor, positions: torch.Tensor, layer: int):
        b = x.shape[0]
        k = (x * (layer + 1) + positions[:, None].to(x.dtype) * 0.01).view(b, self.h, self.d)
        v = (x - 0.1 * layer).view(b, self.h, self.d)
        return k, v

    def __call__(self, input_ids, positions, req_rows, out_cache_loc, seq_lens):
        pool = self.pool
        x = self.emb[input_ids]
        b = x.shape[0]
        idx = pool.req_to_token[req_rows].long()  # [b, ctx]
        mask = self.ctx[None, :] < seq_lens[:, None]  # [b, ctx]
        for layer in range(pool.num_layers):
            k, v = self.kv(x, positions, layer)
            pool.write(layer, out_cache_loc, k, v)
            keys = pool.k_buffer(layer).reshape(-1, self.h, self.d)[idx].float()  # [b, ctx, H, D]
            vals = pool.v_buffer(layer).reshape(-1, self.h, self.d)[idx].float()
            scores = (keys * k.float()[:, None]).sum(-1) / math.sqrt(self.d)  # [b, ctx, H]
            scores = scores.masked_fill(~mask[..., None], float("-inf"))
            p = torch.softmax(scores, dim=1)
            o = (p[..., None] * vals).sum(1)  # [b, H, D]
            x = x + o.reshape(b, -1).to(x.dtype)
        return x.float() @ self.emb.float().T
