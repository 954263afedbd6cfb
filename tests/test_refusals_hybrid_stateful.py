"""The refusal state machine of tests/test_refusals_pool_stateful.py over a hybrid pool,
``KVPool(layer_types=...)`` (a full-attention, a sliding-window and a linear-attention
layer; page size 1 and 4; prefix caching on; pools small enough to evict), against a
twin. The same valid calls (K/V written into each attention layer's new slots), the
same catalogue where the hybrid pool takes the call (its per-layer ``slots`` and
``page_table`` asked for layer 0, its ``evict(layer, n)``), and the same fingerprint
per group: every live request's slots and pages in each attention group, its state
row, each group's page table and counters, every tensor byte for byte.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _pool_refusal_machine import BASES, GRAD_MODES, PoolRefusalMachine, _Bytes, kv_rows
from _pool_refusal_runs import finish_prepared, run_machine, sweep
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from pool_refusal_catalogue import ALLOCATOR_LEVEL, FLAKY_LEVEL, TORCH_LEVEL

import kvpool
from kvpool.hybrid import HybridKVPool

MAX_REQ = 6
TYPES = ["full_attention", "sliding_attention", "linear_attention"]
ATTN = (0, 1)


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    ps: int

    @property
    def max_ctx(self) -> int:
        return 24

    @property
    def pages(self) -> int:
        return 30 if self.ps == 1 else 9

    def build(self, seed: int, pages: int | None = None) -> HybridKVPool:
        return kvpool.KVPool(3, 2, 4, layer_types=TYPES, sliding_window=4, state_shapes={"conv": (3, 4)},
                             dtype=torch.float32, page_size=self.ps, num_pages=pages or self.pages,
                             max_requests=MAX_REQ, max_context_len=self.max_ctx, hash_seed=7, handle_seed=seed)


def _hybrid_evict(args):
    return lambda p, c: (lambda: p.evict(*args))


def _takes(name: str) -> bool:
    method = name.split("(", 1)[0].strip()
    # evict(n), set_clock and priorities are the plain pool's: the hybrid pool's evict names a layer
    return hasattr(HybridKVPool, method) and method not in ("evict",)


HYBRID_ONLY = [(f"evict{args}", _hybrid_evict(args)) for args in ((99, 1), (-1, 1), (0, -1), (0, 1.5), (0, None),
                                                                   (1.5, 1))]


class HybridRefusalMachine(PoolRefusalMachine):
    BAD = [e for e in ALLOCATOR_LEVEL if _takes(e[0])] + TORCH_LEVEL + FLAKY_LEVEL + HYBRID_ONLY
    # The hybrid pool's ExtendResult holds one array per group: the changed-behind case is the plain pool's.
    NOT_HERE = {name for name, _ in TORCH_LEVEL if "changed" in name}

    @initialize(cfg=st.sampled_from([HybridConfig(1), HybridConfig(4)]))
    def setup(self, cfg):
        self._setup(cfg)

    def slot_limit(self, p):
        return max(int(p.k_buffer(g).reshape(-1, 2, 4).shape[0]) for g in ATTN)

    def room(self):
        return (self.a.free_pages(0) + self.a.evictable_pages(0)) * self.ps  # (the sliding group gives pages back)

    def ctx(self, pick):
        return dataclasses.replace(super().ctx(pick), num_layers=3, hybrid=True, own=None)

    def write_new(self, hs, before, res_a, res_t, how):
        tags, pos = [], []
        for h in hs:
            n = int(self.t.length(h))
            tags += [self.tags[h]] * (n - before.get(h, 0))
            pos += list(range(before.get(h, 0), n))
        for layer in ATTN:
            k, v = kv_rows(tags, pos, layer, torch.float32)
            for p, res in ((self.a, res_a), (self.t, res_t)):
                g = res.group_of_layer[layer]
                s = res.out_cache_loc[g] if how == "loc" else res.slots[g]
                assert len(s) == len(tags)
                p.write(layer, s, k, v)
        # each request's state row: written as an engine's linear-attention layer would
        for p in (self.a, self.t):
            st_ = p.state(2, "conv")
            for h in hs:
                st_[int(p.state_slots([h], 2)[0])] = float(self.tags[h] * 100 + p.length(h))

    @rule(n=st.integers(0, 3), layer=st.sampled_from([0, 1]))
    def evict(self, n, layer):
        self.both(lambda p: p.evict(layer, n))

    @rule(data=st.data(), layer=st.sampled_from(list(ATTN)))
    def read(self, data, layer):
        for h in self.pick(data, 2):
            s = self.t.slots(h, layer)
            self.both(lambda p: p.read(layer, s))

    @rule(data=st.data(), layer=st.sampled_from(list(ATTN)))
    def tables(self, data, layer):
        hs = self.pick(data, 3)
        if hs:
            self.both(lambda p: p.page_table(hs, layer))

    @rule(data=st.data(), mode=st.sampled_from(sorted(GRAD_MODES)), layer=st.sampled_from(list(ATTN)))
    def odd_rows(self, data, mode, layer):
        hs = self.pick(data, 1)
        if hs and len(self.t.slots(hs[0], layer)):
            self._odd(data, mode, layer, self.t.slots(hs[0], layer))

    set_clock = None  # (the hybrid pool has no manual clock)

    def fingerprint(self, p):
        p.check()
        per = tuple((h, p.length(h), p.known_tokens(h).tolist(), p.rows([h]).tolist(),
                     tuple(p.slots(h, g).tolist() for g in ATTN), tuple(p.pages(h, g).tolist() for g in ATTN),
                     p.state_slots([h], 2).tolist()) for h in self.live)
        tables = tuple(tuple(x.numpy().tobytes() for x in p.page_table(self.live, g)) for g in ATTN) if self.live else ()
        groups = tuple((p.free_pages(g), p.evictable_pages(g), p.cached_pages(g), p.admissible_tokens(g),
                        p.allocator.pending_copies(g)) for g in range(3))
        tensors = tuple((n, _Bytes(t)) for n, t in p.named_tensors())
        grad = tuple((n, t.requires_grad, t.is_inference()) for n, t in p.named_tensors())
        edits = (p._row_edits, tuple((n, None if h is None else h.tolist()) for n, h in p._edited_rows))
        return (repr(p.stats()), per, tables, groups, p.metadata_bytes, p.admissible_requests,
                tuple(p.is_open(h) for h in self.closed[-4:]), tensors, grad, edits)

    FIELDS = ("stats", "requests", "page_tables", "groups", "metadata_bytes", "admissible_requests", "closed",
              "tensors", "grad", "row_edits")


def test_hybrid_refusals_leave_the_pool_as_it_was():
    run_machine(HybridRefusalMachine)


def prepared(cfg: HybridConfig) -> HybridRefusalMachine:
    """As the plain machine's prepared state: prompted and unprompted requests, a cached
    chain, a fork, a stale handle."""
    m = HybridRefusalMachine()
    m._setup(cfg)
    prompt = BASES[0][: m.max_ctx - 2]
    r, _ = m.both(lambda p: p.open_with_prefix(prompt, [len(prompt)]))
    m.opened(r[0], prompts=[prompt])
    h = int(r[0][0])
    for _ in range(0, len(prompt), 4):  # in steps, as a sliding window's pages go back between them
        before = m.lengths()
        ra, rt = m.both(lambda p: p.extend([h], min(4, len(prompt) - p.length(h))))
        m.write_new([h], before, ra, rt, "loc")
        m.both(lambda p: p.cache([h]))
    return finish_prepared(m, h, prompt)


@pytest.mark.parametrize("ps", [1, 4])
def test_every_catalogue_entry_is_refused_by_the_hybrid_pool_and_changes_nothing(ps):
    sweep(lambda: prepared(HybridConfig(ps)))
