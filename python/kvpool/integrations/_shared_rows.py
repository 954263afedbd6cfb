"""What every pool-backed attention layer of a ``KVPoolCache`` answers alike: its rows are the
cache's requests, shared by every layer, so the batch-wide operations belong to the cache."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from kvpool.errors import IncompleteForwardError


class LayerList(list):  # type: ignore[type-arg]
    """A cache's list of its layers, which the cache's requests hold weakly (``WeakLayers``)."""

    __slots__ = ("__weakref__",)


def _no_layers() -> None:
    return None


class WeakLayers:
    """The ``layers`` attribute of a cache's requests: the cache's ``LayerList``, held weakly.

    Every layer holds the requests, so holding the layers back strongly made a reference cycle
    (requests <-> layers) that kept a dropped cache's requests, their layer buffers and the pool
    they name (its K/V) alive until the cyclic collector ran, which on a long-running server is
    a rare full collection. The cache holds its layers; once it is gone this reads ``()``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name + "_ref"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        got = getattr(obj, self.attr, _no_layers)()
        return () if got is None else got

    def __set__(self, obj: Any, layers: LayerList) -> None:
        setattr(obj, self.attr, weakref.ref(layers) if layers else _no_layers)


class SharedRowsLayer:
    """Mixed in before transformers' ``CacheLayerMixin``; the layer has ``requests`` and ``seen``."""

    requests: Any
    seen: int
    layer_idx: int

    @property
    def batch_size(self) -> int:
        return self.requests.batch_size

    def reset(self) -> None:
        self.seen = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop the whole KVPoolCache (cache.crop), not one layer: rows are shared")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("reorder the whole KVPoolCache (cache.reorder_cache), not one layer")

    def offload(self) -> None:
        raise NotImplementedError("KVPoolCache does not offload: the pool decides where K/V live")

    def join_step(self, tokens: int) -> None:
        """Take this layer's ``tokens`` new tokens into the batch's step: the first layer to see
        them starts the step (extends every row); a later layer must bring the same count, or
        the forward is not one step (``IncompleteForwardError``, before anything is stored)."""
        req = self.requests
        if self.seen == req.length:
            req.begin_step(tokens)
        elif self.seen + tokens != req.length:
            raise IncompleteForwardError(
                f"layer {self.layer_idx} got {tokens} new tokens after {self.seen}, but this step "
                f"extends the rows to {req.length}: every layer must see the same tokens per forward")


def stored_by_all(layers: Sequence[Any]) -> int:
    """How many tokens every layer has stored (the rows' length unless a forward was cut short)."""
    return min((layer.seen for layer in layers), default=0)


def check_in_step(layers: Sequence[Any], length: int, what: str) -> None:
    """Raise ``IncompleteForwardError`` when a layer has not stored the rows' ``length`` tokens:
    the last forward stopped part-way, so building on it would read K/V never stored."""
    for layer in layers:
        if layer.seen != length:
            break
    else:
        return
    done = stored_by_all(layers)
    behind = [layer.layer_idx for layer in layers if layer.seen != length]
    # The last layers alone behind, by the same count: also what a model with fewer layers than the
    # pool leaves after every forward (they are never updated), where no crop helps.
    tail = [layer.layer_idx for layer in layers[len(layers) - len(behind):]]
    fewer = "" if behind != tail or len(behind) == len(layers) or any(
        layer.seen != done for layer in layers if layer.seen != length) else (
        f". If no forward raised, the model has fewer layers than the pool: the pool's layers {behind[0]} and up were "
        f"never updated; build the pool for this model (pool_for_model(model))")
    raise IncompleteForwardError(
        f"{what}: the last forward was cut short: layer{'s' if len(behind) > 1 else ''} "
        f"{', '.join(map(str, behind))} stored {done} tokens, the others {length}. "
        f"crop(-{length - done}) drops the unfinished step (or reset() the cache){fewer}")


def with_step_grad(kv: tuple[torch.Tensor, torch.Tensor], key_states: torch.Tensor,
                   value_states: torch.Tensor, own: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv`` (the rows' K/V read back from the pool, whose last tokens are this step's) with
    the step's own tokens carrying ``key_states``/``value_states``' autograd history.

    The pool holds no autograd history, so without this a forward under grad mode would
    silently get no gradient through its K/V. ``x + (new - new.detach())`` keeps the values
    read back (an fp8 pool's rounding included, as in every other grad mode) and passes
    the gradient to ``new`` unchanged; earlier forwards' K/V stay constants. ``own``: ``kv``
    is the cache's memory, so the one of K/V whose step does not require grad (a frozen k or
    v projection) is returned copied, as ``owned`` does: attention saves it all the same.
    """
    t = key_states.shape[2]
    out = []
    for x, new in zip(kv, (key_states, value_states)):
        if new.requires_grad:
            x = torch.cat([x[:, :, :-t], x[:, :, -t:] + (new - new.detach())], dim=2)
        elif own:
            x = x.clone(memory_format=torch.contiguous_format)
        out.append(x)
    return out[0], out[1]


def owned(kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``kv`` that the cache never writes, for a step under grad mode.

    Attention saves its K/V for the backward whenever its queries require grad, even when
    the K/V do not (frozen k/v projections). What the cache returns otherwise (views of its
    layer buffers, staging buffer or pool) is written again by a later layer or step, and
    autograd refuses a backward through a saved tensor modified in place. Outside grad mode
    nothing is saved, so nothing is copied (``BatchRequests.grad``).
    """
    return kv[0].clone(memory_format=torch.contiguous_format), kv[1].clone(memory_format=torch.contiguous_format)
