"""Training-style forwards (grad mode, every weight trainable) through a linear-attention
model's ``KVPoolCache``: a prompt, then decode steps, one backward per step or one through all.

The model reads a layer's state, saves it for its backward (the gated delta rule multiplies it
by the decay), then hands the new state to the cache. A working copy kept across forwards gave
the next forward the last one's autograd history and took the new state in place, over the
tensor that forward had saved: every backward after the first step raised "modified by an
inplace operation". The oracle is ``DynamicCache`` with every earlier forward's K/V and states
held fixed, as docs/transformers.md promises for attention (``DynamicCache`` alone cannot run
this: it chains the steps' graphs and overwrites its states in place too; see ``reference``).
"""

from __future__ import annotations

import pytest
import torch
from _hf_hybrid_models import tiny  # noqa: I001  (skips without transformers)
from _hf_models import CACHE_KW, left_padded
from transformers import DynamicCache

import kvpool
from kvpool.integrations.transformers import KVPoolCache, pool_for_model


def hold_past(cache: DynamicCache) -> None:
    """The reference's earlier forwards become constants (clones: its next forward writes its
    states in place, which a backward still to come must not see)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            for i, t in list((states or {}).items()):
                if t is not None:
                    states[i] = t.detach().clone()


def reference(model) -> DynamicCache:
    """``DynamicCache`` writes a new recurrent state in place, over the one the model read and
    saved in the same forward, and so cannot run a backward after the first step either: the
    oracle's layers get a fresh tensor to write into."""
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        if hasattr(layer, "update_recurrent_state"):
            def update(states, state_idx=0, _layer=layer, _update=layer.update_recurrent_state, **kwargs):
                old = _layer.recurrent_states.get(state_idx)
                if old is not None:
                    _layer.recurrent_states[state_idx] = old.detach().clone()
                return _update(states, state_idx, **kwargs)
            layer.update_recurrent_state = update
    return cache


def steps():
    ids, mask = left_padded([7, 12, 3], seed=2)
    out = [(ids, mask)]
    for x in torch.randint(3, 90, (3, 3, 1), generator=torch.Generator().manual_seed(1)):
        mask = torch.cat([mask, torch.ones_like(x)], 1)
        out.append((x, mask))
    return out


def train(model, cache, *, each_step: bool):
    """Per step: the logits and (``each_step``) the gradients of that step's loss; else one
    backward through the sum of every step's loss, its gradients last."""
    logits, grads, total = [], [], 0
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        for x, m in steps():
            out = model(input_ids=x, attention_mask=m, **{CACHE_KW: cache}).logits
            loss = out.square().mean()
            logits.append(out.detach())
            if isinstance(cache, DynamicCache):
                hold_past(cache)
            if each_step:
                loss.backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
                model.zero_grad(set_to_none=True)
            else:
                total = total + loss
        if not each_step:
            total.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return logits, grads


@pytest.mark.parametrize("each_step", [True, False], ids=["backward-each-step", "one-backward"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_linear_attention_forwards_backpropagate_with_earlier_states_held_fixed(page_size, each_step):
    model = tiny("qwen3_next").requires_grad_(True)
    ref_logits, ref_grads = train(model, reference(model), each_step=each_step)
    pool = pool_for_model(model, max_tokens=1024, page_size=page_size, max_requests=8)
    with KVPoolCache(pool) as cache:
        logits, grads = train(model, cache, each_step=each_step)
        assert [n for n, t in pool.named_tensors() if t.requires_grad] == []
        assert kvpool.audit(pool) == []
    for a, b in zip(ref_logits, logits):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert len(grads) == len(ref_grads)
    for ref, got in zip(ref_grads, grads):
        assert got.keys() == ref.keys() and got
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    assert pool.open_requests == 0
    pool.check()
