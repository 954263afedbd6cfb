"""``pool_for_model``: a ``KVPool`` shaped for a transformers model or its config
(layers, K/V heads, head size, dtype, device, and the sliding-window and
linear-attention layers of a hybrid model). It reads the config's attributes
(and, for Falcon's new decoder, transformers' version)."""

from __future__ import annotations

from typing import Any

import torch

from kvpool.errors import InvalidArgumentError
from kvpool.integrations._hybrid import hybrid_pool_kwargs
from kvpool.pool import KVPool
from kvpool.torch_types import COMPUTE_DTYPES, FP8_DTYPES
from kvpool.validate import is_int


def layer_values(text: Any, name: str, default: Any = None) -> list[Any]:
    """``[text.<name>]``, or each layer's where transformers refuses a global read of a
    per-layer attribute (a heterogeneous config: ``per_layer_config``)."""
    try:
        return [getattr(text, name, default)]
    except RuntimeError as e:
        if type(e).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
    return [getattr(layer, name, default) for layer in text.per_layer_config]


def config_value(text: Any, name: str, default: Any = None, *, uniform: bool = True) -> Any:
    """``text.<name>`` (``default`` if absent). A heterogeneous config (transformers'
    ``per_layer_config``, as Gemma 4's, whose full-attention layers have their own head_dim)
    refuses a global read of a per-layer attribute with its own RuntimeError: then the value
    every layer has, or a typed refusal naming how they differ (a pool has one K/V shape);
    with ``uniform=False`` (an attribute the pool's shape does not hang on), the first layer's."""
    values = layer_values(text, name, default)
    if len(set(values)) == 1 or not uniform:
        return values[0]
    raise InvalidArgumentError(
        f"pool_for_model: the model's layers differ in {name} ({values}, layer by layer); a KVPool has one "
        f"{name} for every layer: use transformers' DynamicCache for this model")


def falcon_caches_kv_groups() -> bool:
    """Whether transformers' Falcon caches a new-decoder model's K/V groups (5.25 on) rather
    than K/V broadcast to every query head (before)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 25)


def pool_for_model(model: Any, *, max_tokens: int, page_size: int = 16, max_requests: int = 64,
                   max_context_len: int | None = None, device: Any = None, dtype: torch.dtype | None = None,
                   **pool_kwargs: Any) -> KVPool:
    """A ``KVPool`` shaped for ``model`` (a transformers model or its config).

    Args:
        model: ``PreTrainedModel`` or ``PretrainedConfig`` (the decoder's text config is used).
        max_tokens: K/V capacity in tokens (rounded up to whole pages; the reserved page 0 is added).
        page_size, max_requests, **pool_kwargs: passed to ``KVPool``. KV events are off
            unless ``kv_events=True`` is passed: ``KVPoolCache`` never drains them, and a
            router that wants them drains ``pool.take_events()`` itself.
        max_context_len: longest request; default the config's ``max_position_embeddings``.
        device, dtype: default the model's (float32 / cpu for a bare config). An fp8
            ``dtype`` gets the model's dtype as ``compute_dtype`` (the rows its layers
            write and read) unless ``compute_dtype`` is passed or the model's dtype is
            unknown (a bare config without one: then KVPool's default, bfloat16).

    The pool's tensors are created under ``kvpool.persistent()``, so calling this inside
    ``torch.inference_mode()`` is fine.

    Raises:
        InvalidArgumentError: ``max_tokens``, ``page_size`` or ``max_context_len`` is not a
            positive int; ``model`` has no int ``num_attention_heads`` / ``num_hidden_layers``
            (not a decoder's model or config); a multi-head latent attention model (``kv_lora_rank``:
            its cached K and V differ in width); layers that differ in K/V heads or head size (a
            heterogeneous config, as Gemma 4's); and what ``KVPool`` raises for its own arguments.
    """
    # Checked here: the pool's sizes are computed from them before KVPool sees any.
    value: Any
    for name, value in (("max_tokens", max_tokens), ("page_size", page_size), ("max_context_len", max_context_len)):
        if value is None and name == "max_context_len":
            continue
        if not (is_int(value) and value > 0):
            hint = " or None (the config's max_position_embeddings)" if name == "max_context_len" else ""
            raise InvalidArgumentError(f"pool_for_model: {name} must be a positive int{hint}, got {value!r}")
    config = getattr(model, "config", model)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    missing = [a for a in ("num_attention_heads", "num_hidden_layers") if not is_int(config_value(text, a, uniform=False))]
    if missing:
        raise InvalidArgumentError(f"pool_for_model takes a transformers model or its config (a decoder's, with "
                                   f"int num_attention_heads and num_hidden_layers); {type(model).__name__} "
                                   f"{model!r:.60} has no int {' or '.join(missing)}")
    ranks = [r for r in layer_values(text, "kv_lora_rank") if is_int(r) and r > 0]
    if ranks:
        # Multi-head latent attention (DeepSeek V2/V3 and kin; in some layers of others) caches the
        # latent as keys and the rotary part as values, widths differing; a pool's K and V share
        # one head_dim.
        raise InvalidArgumentError(
            f"pool_for_model: {type(config).__name__} uses multi-head latent attention (kv_lora_rank="
            f"{ranks[0]}): its cache holds keys {ranks[0]} wide and values "
            f"{config_value(text, 'qk_rope_head_dim', '?', uniform=False)} wide, and a KVPool's K and V share "
            f"one head_dim; use transformers' DynamicCache for this model")
    # Query heads may differ layer by layer (the pool holds K/V only): they must agree only
    # where the K/V shape is derived from them.
    if getattr(text, "new_decoder_architecture", False):
        # Falcon-40B style: transformers >= 5.25 caches its num_kv_heads K/V heads; before, the
        # model cached K/V already repeated to every query head.
        kv_heads = text.num_kv_heads if falcon_caches_kv_groups() else config_value(text, "num_attention_heads")
    elif getattr(text, "multi_query", False):
        kv_heads = 1  # Falcon-7B / GPTBigCode multi-query: one K/V head, whatever num_kv_heads says
    else:  # (FalconConfig spells it num_kv_heads)
        kv_heads = (config_value(text, "num_key_value_heads") or config_value(text, "num_kv_heads")
                    or config_value(text, "num_attention_heads"))
    head_dim = config_value(text, "head_dim") or config_value(text, "hidden_size") // config_value(
        text, "num_attention_heads")
    if device is None:
        device = getattr(model, "device", "cpu")
    # A model's dtype; a bare config's ``dtype`` is None (or a name) unless it was set.
    model_dtype = getattr(model, "dtype", None)
    if isinstance(model_dtype, str):
        model_dtype = getattr(torch, model_dtype, None)
    if dtype is None:
        dtype = model_dtype if isinstance(model_dtype, torch.dtype) else torch.float32
    elif isinstance(dtype, torch.dtype) and dtype in FP8_DTYPES and "compute_dtype" not in pool_kwargs and model_dtype in COMPUTE_DTYPES:
        # (isinstance first: `in` compares with ==, which an array answers elementwise, untyped.)
        # An fp8 pool takes and returns compute_dtype rows: the model's, which KVPoolCache
        # hands it (KVPool's own default, bfloat16, would refuse every forward of another).
        pool_kwargs["compute_dtype"] = model_dtype
    ctx = max_context_len if max_context_len is not None else getattr(text, "max_position_embeddings", None) or 4096
    pages = -(-int(max_tokens) // page_size) + 1
    pool_kwargs.setdefault("kv_events", False)
    for key, value in hybrid_pool_kwargs(text, ctx).items():  # sliding / linear-attention layers
        pool_kwargs.setdefault(key, value)
    return KVPool(text.num_hidden_layers, kv_heads, head_dim, dtype=dtype, device=device, page_size=page_size,
                  num_pages=pages, max_requests=max_requests, max_context_len=ctx, **pool_kwargs)

