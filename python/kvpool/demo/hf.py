"""``kvpool demo --hf PATH``: the demo engine driving a transformers checkpoint's own layers.

The checkpoint (a local ``save_pretrained`` directory, never downloaded) is loaded with
transformers; ``HFPoolModel.forward_pool`` then runs the model's own modules (embedding,
norms, q/k/v/o projections with their biases, rotary embedding with its scaling, MLP,
LM head) and replaces only the attention's K/V handling: new K/V go into the pool with
``pool.write`` and attention reads every request's K/V back through ``req_to_token``,
exactly as the built-in ``TinyLM`` does. So the engine's continuous batching runs
unchanged on a real architecture, and its outputs can be checked against transformers'
own ``generate``.

Covered: decoder-only Llama-architecture models (``llama``, ``mistral``, ``qwen2``) with
full attention. Anything else is rejected with the reason.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvpool.demo.attention import attend_causal, gather_kv, step_mask

SUPPORTED = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class HFModelInfo:
    """What the engine and the report need to know about the checkpoint."""

    path: str
    model_type: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_positions: int

    def to_dict(self) -> dict[str, Any]:
        return {"hf_path": self.path, "architecture": self.model_type, "vocab_size": self.vocab_size,
                "hidden": self.hidden, "layers": self.layers, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "intermediate": self.intermediate,
                "max_positions": self.max_positions}


def _check_supported(config: Any, max_context: int) -> None:
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        raise ValueError(f"kvpool demo --hf runs Llama-architecture checkpoints ({', '.join(SUPPORTED)}); "
                         f"this one is model_type={kind!r}")
    types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None)
    uses_window = any(t != "full_attention" for t in types) or (
        kind == "mistral" and sliding is not None) or (kind == "qwen2" and getattr(config, "use_sliding_window", False))
    if uses_window and sliding is not None and sliding < max_context:
        raise ValueError(f"this checkpoint uses sliding-window attention (window {sliding}) and requests may reach "
                         f"{max_context} tokens; the demo's attention is full attention: shorten the requests")


class HFPoolModel(nn.Module):
    """A transformers ``*ForCausalLM`` with ``forward_pool`` (the engine's model interface)."""

    def __init__(self, hf: Any, info: HFModelInfo) -> None:
        super().__init__()
        self.hf, self.info, self.cfg = hf, info, info
        self._apply_rotary = sys.modules[type(hf.model).__module__].apply_rotary_pos_emb
        for layer in hf.model.layers:
            if abs(layer.self_attn.scaling - info.head_dim ** -0.5) > 1e-12:
                raise ValueError("attention scaling other than head_dim**-0.5 is not supported by the demo")

    def forward_pool(
        self,
        pool: Any,
        input_ids: torch.Tensor,      # [B, T] new tokens of each request
        positions: torch.Tensor,      # [B, T] their positions
        req_rows: torch.Tensor,       # [B] rows of pool.req_to_token (pool.null_row for padding)
        out_cache_loc: torch.Tensor,  # [B*T] slots the new tokens' K/V go to
        width: int,                   # req_to_token columns to gather (>= longest request)
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] ([B, 1, vocab] if last_only); new K/V are stored on the way."""
        m, info = self.hf.model, self.info
        x = m.embed_tokens(input_ids)
        cos, sin = m.rotary_emb(x, positions)
        slot_idx = pool.req_to_token[req_rows, :width].long()
        mask = step_mask(positions, info.heads, width)
        b, t = input_ids.shape
        for i, layer in enumerate(m.layers[: info.layers]):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, t, info.heads, info.head_dim)
            k = attn.k_proj(h).view(b, t, info.kv_heads, info.head_dim)
            v = attn.v_proj(h).view(b, t, info.kv_heads, info.head_dim)
            q, k = self._apply_rotary(q, k, cos, sin, unsqueeze_dim=2)  # [B, T, H, D] layout
            pool.write(i, out_cache_loc, k.reshape(-1, info.kv_heads, info.head_dim),
                       v.reshape(-1, info.kv_heads, info.head_dim))
            keys, values = gather_kv(pool, i, slot_idx)
            x = x + attn.o_proj(attend_causal(q, keys, values, positions, mask).flatten(-2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if last_only:
            x = x[:, -1:]
        return self.hf.lm_head(m.norm(x)).float()


def load_hf_model(path: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  max_context: int = 0, progress: bool = True) -> HFPoolModel:
    """Load a local ``save_pretrained`` directory (no network) as an engine model.

    ``progress=False`` hides transformers' weight-loading bar (``kvpool demo --no-progress``).
    Built under ``inference_mode(False)`` then ``no_grad()`` so the weights are normal
    tensors whatever mode the caller is in; parameters are frozen.

    Raises:
        ImportError: transformers is not installed (``pip install 'kvpool[hf]'``).
        ValueError: not a supported architecture, or sliding-window attention shorter
            than ``max_context``.
        OSError: ``path`` is not a saved checkpoint.
    """
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise ImportError("kvpool demo --hf needs transformers>=5.23,<6: pip install 'kvpool[hf]'") from e
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    _check_supported(config, max_context)
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    with torch.inference_mode(False), torch.no_grad():
        if not progress:
            hf_logging.disable_progress_bar()
        try:
            hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        finally:
            if shown:  # (a process-wide setting: give the caller theirs back)
                hf_logging.enable_progress_bar()
        hf.requires_grad_(False)
        hf.to(device)  # type: ignore[arg-type]  # transformers' decorated .to() confuses mypy
        hf.eval()
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    info = HFModelInfo(path=str(path), model_type=c.model_type, vocab_size=c.vocab_size, hidden=c.hidden_size,
                       layers=c.num_hidden_layers, heads=c.num_attention_heads,
                       kv_heads=c.num_key_value_heads or c.num_attention_heads, head_dim=head_dim,
                       intermediate=c.intermediate_size, max_positions=c.max_position_embeddings)
    with torch.inference_mode(False), torch.no_grad():
        return HFPoolModel(hf, info)
