"""PoolViews: what a KVPool shows of its tensors without changing them.

The memory figures (``nbytes``, ``overhead_bytes``, ``named_tensors``) and the
per-layer views of the caches (``k_buffer``, ``v_buffer``, ``kv_buffer`` and
their lists). Every method only reads the pool's storage; the views are views,
no copies. A mixin of ``KVPool`` (kept apart so pool.py holds construction and
the table-writing calls).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvpool._core import InvalidArgumentError, SlotAllocator
from kvpool.validate import check_layer

if TYPE_CHECKING:
    from kvpool.tiers.host_storage import HostStorage

__all__ = ["PoolViews"]


class PoolViews:
    """The read-only half of ``KVPool``: memory figures and cache views."""

    num_layers: int
    mla: bool
    kv_lora_rank: int | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    req_to_token: torch.Tensor
    allocator: SlotAllocator  # (first in KVPool's MRO: this is what type checkers read)
    host: HostStorage | None
    _storage: Any

    # ----- memory figures -------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V (or latent) caches."""
        return self._storage.nbytes

    @property
    def overhead_bytes(self) -> int:
        """Memory the pool uses beyond the K/V bytes: tables, scales, allocator metadata."""
        scales = sum(s.nbytes for s in {id(s): s for s in (self.k_scale, self.v_scale) if s is not None}.values())
        table = self.req_to_token.untyped_storage().nbytes()  # with the row padding
        return table + scales + int(self.allocator.metadata_bytes)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every persistent tensor the pool owns (``audit`` walks these)."""
        out = self._storage.tensors() + [("req_to_token", self.req_to_token)]
        if self.k_scale is not None:
            out.append(("k_scale", self.k_scale))
        if self.v_scale is not None and self.v_scale is not self.k_scale:
            out.append(("v_scale", self.v_scale))
        if self.host is not None:
            out += self.host.tensors()
        return out

    # ----- views ----------------------------------------------------------

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Layer's K cache in the pool's layout (MLA: the latent cache). A view, no copy.

        Returns:
            ``[num_slots, H, D]`` (layout ``"token"``) or ``[num_pages, P, H, D]`` (``"paged"``).

        Raises:
            LayerIndexError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        return self._storage.shaped[0][check_layer(layer, self.num_layers)]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """Layer's V cache in the pool's layout (MLA: the first ``kv_lora_rank`` features
        of the latent cache). A view, no copy.

        Raises:
            LayerIndexError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        layer = check_layer(layer, self.num_layers)
        if self.mla:
            return self._storage.shaped[0][layer][..., : self.kv_lora_rank]
        return self._storage.shaped[1][layer]

    def kv_buffer(self, layer: int) -> torch.Tensor:
        """MLA latent cache ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]`` (paged: split pages).

        Raises:
            InvalidArgumentError: the pool is not MLA.
            LayerIndexError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        if not self.mla:
            raise InvalidArgumentError("kv_buffer() is for MLA pools; use k_buffer()/v_buffer()")
        return self._storage.shaped[0][check_layer(layer, self.num_layers)]

    @property
    def caches(self) -> list[torch.Tensor]:
        """The pool's caches as whole tensors: ``[K, V]`` (or ``[latent]`` on an MLA pool),
        each ``[num_layers, num_slots, H, D]``, every layer's buffer a view of one. What the
        page movers take (``kvpool.kernels.offload_pages`` / ``load_pages``)."""
        return list(self._storage.caches)

    @property
    def k_buffers(self) -> list[torch.Tensor]:
        """``k_buffer(layer)`` of every layer (SGLang's ``k_buffer`` list)."""
        return list(self._storage.shaped[0])

    @property
    def v_buffers(self) -> list[torch.Tensor]:
        """``v_buffer(layer)`` of every layer."""
        return [self.v_buffer(i) for i in range(self.num_layers)] if self.mla else list(self._storage.shaped[1])
