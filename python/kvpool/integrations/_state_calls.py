"""The linear-attention calls of a hybrid ``KVPoolCache`` (``get_conv_state``, ``update_conv_state``,
``get_recurrent_state``, ``update_recurrent_state``, ``has_previous_state``): their layer and state
indices checked, with the typed error transformers' ``Cache`` lacks (it raised ``ValueError``,
``KeyError``, ``IndexError`` or ``TypeError``); a layer that is an attention layer of the pool
(the pool built for another model) is an ``InvalidArgumentError`` that says so."""

from __future__ import annotations

import operator
from typing import Any

import torch

from kvpool.errors import InvalidArgumentError, LayerIndexError
from kvpool.integrations._batch_edits import _layer_index
from kvpool.integrations._hybrid_state import PoolStateLayer, state_name

__all__ = ["StateCalls", "not_for_this_model"]


def not_for_this_model(pool: Any, layer_idx: int, what: str, has: str, wants: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{what}: layer {layer_idx} of the pool is {has} (its layer_types are {list(pool.layer_types)}), but the "
        f"model {wants} there: the pool was built for another model; build it for this one (pool_for_model(model))")


class StateCalls:
    """Mixed in before ``KVPoolCache`` by ``HybridKVPoolCache`` (``layers``, ``pool``, the reset note)."""

    layers: list[Any]
    pool: Any
    _reset_mid: frozenset[int] | None

    def _state_layer(self, layer_idx: Any, state_idx: Any, what: str, *,
                     any_state: bool = False) -> tuple[int, int, PoolStateLayer]:
        """The checked ``(layer_idx, state_idx, layer)`` of a state call (``any_state``: None is all states)."""
        if type(layer_idx) is not int:
            layer_idx = _layer_index(layer_idx, len(self.layers))
        layers = self.layers
        if not 0 <= layer_idx < len(layers):
            raise LayerIndexError(f"{what}: layer_idx {layer_idx}: the pool has layers [0, {len(layers)})")
        layer = layers[layer_idx]
        if not isinstance(layer, PoolStateLayer):
            kind = "a sliding-window" if layer.is_sliding else "a full"
            raise not_for_this_model(self.pool, layer_idx, what, f"{kind} attention layer, which keeps no state",
                                     "keeps a linear-attention state")
        if (state_idx is not None or not any_state) and type(state_idx) is not int:
            try:
                if isinstance(state_idx, bool):
                    raise TypeError
                state_idx = operator.index(state_idx)
            except TypeError:
                raise InvalidArgumentError(f"{what}: state_idx takes an int, got {type(state_idx).__name__} "
                                           f"{state_idx!r}") from None
        if state_idx is not None and not 0 <= state_idx < layer.number_of_states:
            names = sorted(n for n in self.pool.state_shapes if n.startswith(("conv", "recurrent")))
            raise InvalidArgumentError(
                f"{what}: state_idx {state_idx}: layer {layer_idx} keeps {layer.number_of_states} state(s) of each "
                f"kind, state_idx [0, {layer.number_of_states}) (the pool's states: {names})")
        return layer_idx, state_idx, layer  # type: ignore[return-value]

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any) -> Any:
        """``Cache.update_conv_state``; refused for a layer a reset during this forward left behind."""
        if self._reset_mid is not None:
            self._check_reset_mid_step(layer_idx)  # type: ignore[attr-defined]  # (BatchEdits)
        layer_idx, state_idx, layer = self._state_layer(layer_idx, state_idx, "update_conv_state")
        return layer.update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> Any:
        """As ``update_conv_state``."""
        if self._reset_mid is not None:
            self._check_reset_mid_step(layer_idx)  # type: ignore[attr-defined]  # (BatchEdits)
        layer_idx, state_idx, layer = self._state_layer(layer_idx, state_idx, "update_recurrent_state")
        return layer.update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """``Cache.get_conv_state``; the model may update what it gets in place (a decode step's
        ``causal_conv1d_update``), so the layer counts this forward as touching the state."""
        layer_idx, state_idx, layer = self._state_layer(layer_idx, state_idx, "get_conv_state")
        out = super().get_conv_state(layer_idx, state_idx)  # type: ignore[misc]
        if out is not None:
            layer.stamp(state_name("conv", state_idx), read=True)
        return out

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """As ``get_conv_state`` (Mamba's decode updates the recurrent state in place too)."""
        layer_idx, state_idx, layer = self._state_layer(layer_idx, state_idx, "get_recurrent_state")
        out = super().get_recurrent_state(layer_idx, state_idx)  # type: ignore[misc]
        if out is not None:
            layer.stamp(state_name("recurrent", state_idx), read=True)
        return out

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """``Cache.has_previous_state`` (False past the last layer, as there), with its indices checked."""
        if layer_idx is not None:
            if type(layer_idx) is not int:
                layer_idx = _layer_index(layer_idx, len(self.layers))
            if layer_idx >= len(self.layers):
                return False
            layer_idx, state_idx, _ = self._state_layer(layer_idx, state_idx, "has_previous_state", any_state=True)
        return super().has_previous_state(layer_idx, state_idx)  # type: ignore[misc]
