"""How a hybrid ``KVPool`` splits its layers into groups and its memory between them.

Layers are named as in Hugging Face configs (``config.layer_types``). Layers with
the same lifetime rule share one group of the core's ``GroupedAllocator``: every
``"full_attention"`` layer one ``full`` group, every ``"sliding_attention"`` layer
one ``sliding`` group of the pool's window, ``"linear_attention"`` and ``"mamba"``
layers one ``state`` group each. Nothing here allocates memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvpool._core import InvalidArgumentError
from kvpool.capacity import MAX_PAGES, MAX_SLOTS, slot_limit_hint

__all__ = ["LAYER_KINDS", "LayerGroup", "check_slot_ids", "plan_groups", "plan_states", "primary_pages_for_budget"]

# Hugging Face layer type -> the core's group kind.
LAYER_KINDS = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "linear_attention": "state",
    "mamba": "state",
}


@dataclass(frozen=True)
class LayerGroup:
    """One group of the pool: its index in the allocator, the layers it serves and its size."""

    index: int
    layer_type: str
    kind: str  # "full", "sliding" or "state"
    layers: tuple[int, ...]
    page_size: int  # tokens per page (0 for a state group)
    window: int | None  # sliding groups only
    num_pages: int  # pages (state slots for a state group), reserved page 0 included

    def spec(self) -> dict[str, Any]:
        """The group dict ``GroupedAllocator`` takes."""
        if self.kind == "state":
            return {"kind": "state", "num_slots": self.num_pages, "checkpoint_every": 0}
        out: dict[str, Any] = {"kind": self.kind, "num_pages": self.num_pages, "page_size": self.page_size}
        if self.window is not None:
            out["window"] = self.window
        return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _count(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _per_type(name: str, value: Any, layer_type: str, default: Any) -> Any:
    """``value`` itself, or its entry for ``layer_type`` when it is a dict keyed by layer type."""
    if isinstance(value, Mapping):
        return value.get(layer_type, default)
    return value


def plan_groups(
    layer_types: Any,
    *,
    num_layers: int,
    sliding_window: Any,
    page_size: Any,
    num_pages: int | None,
    group_pages: Mapping[str, int] | None,
    max_requests: int,
    max_context_len: int,
) -> list[LayerGroup]:
    """The pool's groups, in order of each layer type's first layer.

    Sizes: ``num_pages`` (reserved page included) sizes each full group, or each
    sliding group of a pool without one; ``group_pages[layer_type]`` sets any
    group explicitly; the rest get what their requests can need at once: a
    sliding group ``ceil((W - 1) / P) + 1`` pages a request (its window of W tokens
    from the newest token's page), and one
    longest prompt; a state group one slot per request and as many for
    checkpoints (plus the reserved slot).
    """
    if isinstance(layer_types, (str, bytes)) or not isinstance(layer_types, Sequence):
        raise InvalidArgumentError(
            f"layer_types must be a list of layer type names (one per layer), got {type(layer_types).__name__}")
    types = list(layer_types)
    if len(types) != num_layers:
        raise InvalidArgumentError(f"layer_types has {len(types)} entries; the pool has num_layers={num_layers}")
    for i, t in enumerate(types):
        if not isinstance(t, str) or t not in LAYER_KINDS:
            raise InvalidArgumentError(
                f"layer_types[{i}] = {t!r} is not a supported layer type; use one of {sorted(LAYER_KINDS)}")
    if not any(LAYER_KINDS[t] != "state" for t in types):
        raise InvalidArgumentError("a hybrid pool needs at least one attention layer (full or sliding): "
                                   "the request length is counted in attention pages")
    if group_pages is not None and not isinstance(group_pages, Mapping):
        raise InvalidArgumentError(f"group_pages must be a dict {{layer type name: pages}}, "
                                   f"got {type(group_pages).__name__}")
    explicit = dict(group_pages or {})
    # A key no layer has is a typo: ignored, the group it meant would get the default.
    for what, keys in (("group_pages", explicit), ("page_size", page_size if isinstance(page_size, Mapping) else {})):
        for key in keys:
            if key not in types:
                raise InvalidArgumentError(f"{what} names {key!r}, which is not among layer_types "
                                           f"{sorted(set(types))}")
    if isinstance(page_size, Mapping):
        # A state layer has no pages: its entry would be dropped without a word, as a typo would.
        for key in page_size:
            if LAYER_KINDS.get(key) == "state":
                paged = sorted({t for t in types if LAYER_KINDS[t] != "state"})
                raise InvalidArgumentError(
                    f"page_size names {key!r}, a state layer type: its layers keep one state row per "
                    f"request, not pages; give page sizes for {paged} only (size its rows with group_pages)")
    # A Python int: a numpy one stayed in LayerGroup.num_pages (and its spec), skipped the
    # sliding group's cap below (sized as without a full group), and a str reached
    # check_slot_ids' arithmetic as a TypeError. The core checks the range.
    if num_pages is not None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)):
            raise InvalidArgumentError(f"num_pages must be an int, got {type(num_pages).__name__} {num_pages!r}")
        num_pages = int(num_pages)
    window: int | None = None
    if "sliding_attention" in types:
        if sliding_window is None:
            raise InvalidArgumentError("layer_types has sliding_attention layers: pass sliding_window=W "
                                       "(the config's sliding_window)")
        window = _count("sliding_window", sliding_window)
    has_full = "full_attention" in types
    order = list(dict.fromkeys(types))
    groups: list[LayerGroup] = []
    for index, t in enumerate(order):
        kind = LAYER_KINDS[t]
        layers = tuple(i for i, x in enumerate(types) if x == t)
        size_given = explicit.get(t)
        if kind == "state":
            slots = 2 * max_requests + 1 if size_given is None else _count(f"group_pages[{t!r}]", size_given, 2)
            groups.append(LayerGroup(index, t, kind, layers, 0, None, slots))
            continue
        p = _count(f"page_size[{t!r}]" if isinstance(page_size, Mapping) else "page_size",
                   _per_type("page_size", page_size, t, 1))
        if size_given is not None:
            pages = _count(f"group_pages[{t!r}]", size_given, 2)
        elif kind == "full" or not has_full:
            if num_pages is None:
                raise InvalidArgumentError(
                    f"size the {t} layers' pages: pass num_pages or num_slots (or group_pages={{{t!r}: N}})")
            if num_pages < 2:  # (the core's check names its groups[i]["num_pages"], not this argument)
                raise InvalidArgumentError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
            pages = num_pages
        else:
            assert window is not None
            need = max_requests * (_cdiv(window - 1, p) + 1) + _cdiv(max_context_len, p) + 1
            # Never more than the full group's tokens can fill (a window is part of the context), in
            # this group's pages: each request's window may start and end inside a page, so two more
            # a request that holds any (the tokens alone undercounted, and requests well within their
            # context ran this group dry while the full group had room); such a request holds a page
            # of the full group too, so there are no more of them than its pages.
            cap = need
            if has_full and explicit.get("full_attention", num_pages) is not None:
                full_pages = explicit.get("full_attention", num_pages)
                full_p = _per_type("page_size", page_size, "full_attention", 1)
                if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in (full_pages, full_p)) \
                        and full_p >= 1:
                    full_pages, full_p = int(full_pages), int(full_p)
                    cap = full_pages * full_p // p + 2 * min(max_requests, full_pages) + 1
            pages = min(need, cap)
        groups.append(LayerGroup(index, t, kind, layers, p, window if kind == "sliding" else None, pages))
    return groups


# A state row is zeroed for a new request and copied for a fork or checkpoint with
# index_fill_ / index_select / index_copy_ (hybrid_copies.py), after the core has changed:
# torch implements those for these dtypes only (not fp8, not uint16-64), so any other is
# refused when the pool is built rather than at the first open.
STATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
                torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)


def plan_states(state_shapes: Any, dtype: torch.dtype, has_state: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``state_shapes`` as ``{name: (shape per request, dtype)}``: each value a shape
    (the pool's dtype) or a ``(shape, dtype)`` pair."""
    if state_shapes is not None and not isinstance(state_shapes, Mapping):
        raise InvalidArgumentError(f"state_shapes must be a dict {{name: shape per request}}, "
                                   f"got {type(state_shapes).__name__}")
    if not has_state:
        if state_shapes:
            raise InvalidArgumentError("state_shapes is for linear_attention / mamba layers; layer_types has none")
        return {}
    if not isinstance(state_shapes, Mapping) or not state_shapes:
        raise InvalidArgumentError(
            "layer_types has linear_attention / mamba layers: pass state_shapes={name: shape per request}, "
            "e.g. {'conv': (conv_dim, kernel), 'recurrent': (heads, k_dim, v_dim)}")
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, value in state_shapes.items():
        shape, dt = value, dtype
        if (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.dtype)):
            shape, dt = value
        if not isinstance(name, str) or not isinstance(shape, (tuple, list)) or not all(
                isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 1 for s in shape):
            raise InvalidArgumentError(
                f"state_shapes[{name!r}] must be a shape of positive ints (or (shape, dtype)), got {value!r}")
        if dt not in STATE_DTYPES:
            raise InvalidArgumentError(
                f"state_shapes[{name!r}] has dtype {dt}, which torch cannot zero and copy by rows "
                f"(index_fill_ / index_copy_); give a state dtype among {[str(d) for d in STATE_DTYPES]}")
        out[name] = (tuple(int(s) for s in shape), dt)
    return out


def primary_pages_for_budget(
    budget: int, *, token_bytes: int, table_bytes: int,
    states: Mapping[str, tuple[tuple[int, ...], torch.dtype]], **plan: Any,
) -> int:
    """Pages of the primary group (the full one, else the sliding one) that fit in
    ``budget`` bytes once every other group has what its requests need and every
    page group has its table. ``token_bytes``: one token's K and V in one layer."""
    draft = plan_groups(num_pages=1 << 40, **plan)  # a cap that never binds: each other group's need
    primary = next((g for g in draft if g.kind == "full"), None) or next(g for g in draft if g.kind == "sliding")
    if primary.layer_type in (plan.get("group_pages") or {}):
        # The budget sizes this group; a fixed size for it too would win over the budget.
        raise InvalidArgumentError(
            f"group_pages[{primary.layer_type!r}] and memory_bytes / memory_fraction both size the "
            f"{primary.layer_type} layers' pages: give one (group_pages may size the other groups)")
    row = sum(int(np.prod(shape)) * dt.itemsize for shape, dt in states.values())
    fixed = 0
    for g in draft:
        if g.kind == "state":
            fixed += g.num_pages * len(g.layers) * row
            continue
        fixed += table_bytes
        if g is not primary:
            fixed += g.num_pages * g.page_size * len(g.layers) * token_bytes
    page_bytes = primary.page_size * len(primary.layers) * token_bytes
    pages = (budget - fixed) // page_bytes if budget > fixed else 0
    if pages < 2:
        raise InvalidArgumentError(
            f"a budget of {budget} bytes leaves {max(pages, 0)} pages of {page_bytes} bytes for the "
            f"{primary.layer_type} layers after {fixed} bytes of other groups and tables; need >= "
            f"{fixed + 2 * page_bytes} bytes (or size the groups with num_pages and group_pages)")
    return int(pages)


def check_slot_ids(groups: list[LayerGroup], budget: str | None = None) -> None:
    """Refuse, before anything is allocated, a page group whose slot ids would pass int32
    (its table's type), as the plain pool does (``capacity.MAX_SLOTS``). ``budget``: the
    argument (``memory_bytes`` or ``memory_fraction``) that sized the primary group, which is
    then what the caller should lower."""
    primary = next((g for g in groups if g.kind == "full"), None) or next(
        (g for g in groups if g.kind == "sliding"), None)
    for g in groups:
        if g.kind == "state" or g.num_pages * g.page_size <= MAX_SLOTS:
            continue
        if budget is not None and g is primary:
            raise InvalidArgumentError(
                f"{budget} gives the {g.layer_type} layers {g.num_pages} pages of {g.page_size} slots, "
                f"{g.num_pages * g.page_size} slots, more than the {MAX_SLOTS} (2**31) that int32 tables "
                f"address: use a smaller {budget}, one that gives these layers at most "
                f"{min(MAX_SLOTS // g.page_size, MAX_PAGES)} pages")
        raise InvalidArgumentError(
            f"the {g.layer_type} layers' {g.num_pages} pages of {g.page_size} slots are "
            f"{g.num_pages * g.page_size} slots, more than the {MAX_SLOTS} (2**31) that int32 tables "
            f"address; {slot_limit_hint(g.page_size, 'num_pages')} for this group (num_pages=, or "
            f"group_pages={{{g.layer_type!r}: N}} where its pages are set apart)")
