"""HybridViews: what a hybrid ``KVPool`` shows of its tensors without changing them.

The per-layer views of its group's storage (``k_buffer``, ``v_buffer``, ``state``) and the
memory figures (``nbytes``, ``overhead_bytes``, ``named_tensors``). Every method only reads
the pool's storage; the views are views, no copies. A mixin of ``HybridKVPool`` (kept apart
so hybrid.py holds construction and geometry), as ``PoolViews`` is of the plain pool.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool._core import InvalidArgumentError
from kvpool.hybrid_plan import LayerGroup
from kvpool.layout import KVStorage

__all__ = ["HybridViews"]


class HybridViews:
    """The read-only views of ``HybridKVPool``."""

    # HybridKVPool's state these read (made by its __init__).
    allocator: Any
    groups: list[LayerGroup]
    state_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    _storage: list[KVStorage | None]
    _tables: list[torch.Tensor | None]
    _states: list[dict[str, torch.Tensor] | None]
    _slot_in_group: dict[int, int]
    _page_group: Any  # (HybridKVPool's: the group of a layer with pages / with state)
    _state_group: Any

    # ----- per-layer views ---------------------------------------------------

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Layer's K cache in the pool's layout (its group's slots). A view, no copy."""
        g = self._page_group(layer)
        st = self._storage[g.index]
        assert st is not None
        return st.shaped[0][self._slot_in_group[layer]]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """Layer's V cache in the pool's layout. A view, no copy."""
        g = self._page_group(layer)
        st = self._storage[g.index]
        assert st is not None
        return st.shaped[1][self._slot_in_group[layer]]

    def state(self, layer: int, name: str) -> torch.Tensor:
        """Layer's state tensor ``name``: ``[num_slots, *state_shapes[name]]``; a request's
        row is its ``state_slots``.

        Raises:
            LayerIndexError, InvalidArgumentError: not a state layer, or no such name.
        """
        g = self._state_group(layer)
        if not isinstance(name, str) or name not in self.state_shapes:  # a list is unhashable: TypeError
            raise InvalidArgumentError(f"no state named {name!r}; state_shapes has {sorted(self.state_shapes)}")
        states = self._states[g.index]
        assert states is not None
        return states[f"{layer}.{name}"]

    # ----- memory figures -----------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V caches and state tensors of every group."""
        kv = sum(s.nbytes for s in self._storage if s is not None)
        return kv + sum(t.numel() * t.element_size() for st in self._states if st for t in st.values())

    @property
    def overhead_bytes(self) -> int:
        """Tables and allocator metadata."""
        tables = sum(t.untyped_storage().nbytes() for t in self._tables if t is not None)
        return tables + int(self.allocator.metadata_bytes)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every persistent tensor the pool owns (``audit`` walks these)."""
        out: list[tuple[str, torch.Tensor]] = []
        for g, st, table, states in zip(self.groups, self._storage, self._tables, self._states):
            if st is not None and table is not None:
                out += [(f"{g.layer_type}.{name}", t) for name, t in st.tensors()]
                out.append((f"{g.layer_type}.req_to_token", table))
            if states:
                out += [(f"{g.layer_type}.state.{k}", t) for k, t in states.items()]
        return out
