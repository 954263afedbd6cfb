"""Transfer refusals that say what happened. First: a transfer refused for want of room
that the receiver's ``free_pages`` seemed to have.

``free_pages`` counts the CACHED pages no request holds; a request whose leading pages
the receiver caches holds those, and then they are no longer room. The receiver's core
refuses that case (nothing changes), but the sender's ``TransferRejectedError`` used to
say "it needs 3 free pages for 20 tokens but has 4": a refusal that contradicts itself.
It now says the pages needed are beyond the ones cached, and that holding those leaves
fewer than needed. Also: an incompatible receiver names the dtypes and cache kinds that
differ instead of their wire codes; a receiver whose open fails on the device refuses the
sender at once instead of leaving it to its timeout; every refusal reason is documented.

Both sides run in this process, on two threads joined by an in-memory link in place of
torch.distributed (``kv_transfer._Link`` / ``kv_receive._Link`` are the seams), so the
test needs no process group and takes well under a second.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np
import pytest
import torch

import kvpool
from kvpool.distributed import comm, kv_receive, kv_transfer

P = 4
PROMPT = list(range(100, 100 + 5 * P))  # 5 full pages


class _Done:
    def __init__(self, fn: Any = None) -> None:
        self.fn = fn

    def wait(self, timeout: Any = None) -> bool:
        if self.fn is not None:
            self.fn(timeout)
        return True


def _links(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connect every sender link to every receiver link of this process through two queues."""
    to_dst: queue.Queue = queue.Queue()
    to_src: queue.Queue = queue.Queue()

    def link_class(out_q: queue.Queue, in_q: queue.Queue) -> type:
        class Loop(comm.Link):
            def send(self, t: torch.Tensor, what: str) -> Any:
                self.messages += 1
                out_q.put(t.detach().clone())
                return _Done()

            def post_recv(self, t: torch.Tensor, what: str) -> Any:
                self.messages += 1

                def land(timeout: Any) -> None:
                    got = in_q.get(timeout=10).reshape(-1).view(torch.uint8)
                    flat = t.reshape(-1).view(torch.uint8)
                    flat[: got.numel()].copy_(got[: flat.numel()])  # (gloo: a shorter message fills a prefix)
                return _Done(land)
        return Loop

    monkeypatch.setattr(kv_transfer, "_Link", link_class(to_dst, to_src))
    monkeypatch.setattr(kv_receive, "_Link", link_class(to_src, to_dst))
    for mod in (kv_transfer, kv_receive):
        monkeypatch.setattr(mod, "check_peer", lambda *a, **k: None)
        monkeypatch.setattr(mod, "comm_device", lambda *a, **k: torch.device("cpu"))


def _pool(num_pages: int) -> kvpool.KVPool:
    return kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=P, num_pages=num_pages, max_requests=4,
                         max_context_len=64, hash_seed=7)


def _both(send: Any, recv: Any) -> tuple[Any, Any]:
    out: dict[str, Any] = {}

    def run(name: str, fn: Any) -> None:
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - the test checks the class and message
            out[name] = e
    threads = [threading.Thread(target=run, args=(n, f), daemon=True) for n, f in (("s", send), ("r", recv))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a side of the transfer hung"
    return out["s"], out["r"]


def test_a_refusal_for_room_the_cached_prefix_took_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    _links(monkeypatch)
    src = _pool(32)
    hs, _ = src.open_with_prefix(PROMPT, [len(PROMPT)])
    src.extend(hs, len(PROMPT), tokens=PROMPT)
    for layer in range(2):
        rows = torch.arange(len(PROMPT) * 16, dtype=torch.float32).reshape(len(PROMPT), 2, 8) + layer
        src.write(layer, src.slots(int(hs[0])), rows, -rows)
    dst = _pool(7)  # 6 usable pages
    toks = PROMPT[: 2 * P] + [1]
    h, _ = dst.open_with_prefix(toks, [len(toks)])
    dst.extend(h, len(toks), tokens=toks)
    dst.close(h, cache=True)  # the first 2 pages of PROMPT are cached, no request holds them
    filler = dst.open(1)
    dst.extend(filler, 2 * P)
    dst.take_events()
    # free_pages (4) counts the 2 cached pages: 3 more are needed, only 2 are room once those are held.
    assert (dst.free_pages, dst.cached_pages) == (4, 2)
    before = (repr(dst.stats()), repr(src.stats()))
    sent, got = _both(lambda: kv_transfer.send_request(src, int(hs[0]), 1, timeout_s=10),
                      lambda: kv_receive.recv_request(dst, 0, timeout_s=10))
    assert isinstance(got, kvpool.PoolExhaustedError), got
    assert isinstance(sent, kvpool.TransferRejectedError) and sent.reason == "exhausted", sent
    msg = str(sent)
    assert "needs 3 free pages for 20 tokens beyond the 2 leading pages it already caches" in msg, msg
    assert "fewer once it holds those" in msg and "but has 4" not in msg, msg
    assert (repr(dst.stats()), repr(src.stats())) == before
    assert len(dst.take_events()["kind"]) == 0
    dst.check()
    src.check()
    # Room made: the same transfer goes through, the cached pages not sent, every row exact.
    dst.close(filler)
    sent, got = _both(lambda: kv_transfer.send_request(src, int(hs[0]), 1, timeout_s=10),
                      lambda: kv_receive.recv_request_stats(dst, 0, timeout_s=10))
    assert not isinstance(sent, Exception) and not isinstance(got, Exception), (sent, got)
    assert (sent.cached_pages, got.cached_pages, got.pages) == (2, 2, 5)
    for layer in range(2):
        k, v = dst.read(layer, dst.slots(got.handle))
        sk, sv = src.read(layer, src.slots(int(hs[0])))
        assert torch.equal(k[2 * P :], sk[2 * P :]) and torch.equal(v[2 * P :], sv[2 * P :])
    dst.check()


def test_a_refusal_with_too_few_free_pages_still_says_how_many(monkeypatch: pytest.MonkeyPatch) -> None:
    _links(monkeypatch)
    src = _pool(32)
    h = int(src.open(1)[0])
    src.extend([h], 20)
    dst = _pool(4)  # 3 usable pages, 5 needed
    sent, got = _both(lambda: kv_transfer.send_request(src, h, 1, timeout_s=10),
                      lambda: kv_receive.recv_request(dst, 0, timeout_s=10))
    assert isinstance(got, kvpool.PoolExhaustedError), got
    assert isinstance(sent, kvpool.TransferRejectedError) and "it needs 5 free pages for 20 tokens but has 3" in str(sent)
    assert np.asarray(dst.pages(int(dst.open(1)[0]))).size == 0  # (the pool still works)


@pytest.mark.parametrize("kw, text", [
    (dict(dtype=torch.bfloat16), "dtype float32 vs bfloat16"),
    (dict(dtype=torch.float8_e4m3fn), "dtype float32 vs float8_e4m3fn"),
    (dict(kv_lora_rank=4, qk_rope_head_dim=4, num_kv_heads=1),
     "cache kinds 2 (K and V caches) vs 1 (an MLA latent cache)"),
])
def test_an_incompatible_receiver_names_the_dtypes_and_caches_that_differ(monkeypatch: pytest.MonkeyPatch,
                                                                            kw: dict, text: str) -> None:
    """The receiver's refusal showed the wire codes ("dtype 0 vs 2", "MLA-ness 2 vs 1"),
    which say nothing to a reader; it names them now."""
    _links(monkeypatch)
    src = _pool(16)
    h = int(src.open(1)[0])
    src.extend([h], 6)
    heads = kw.pop("num_kv_heads", 2)
    dst = kvpool.KVPool(2, heads, 8, page_size=P, num_pages=16, max_requests=4, max_context_len=64,
                        **{"dtype": torch.float32, **kw})
    before = repr(dst.stats())
    sent, got = _both(lambda: kv_transfer.send_request(src, h, 1, timeout_s=10),
                      lambda: kv_receive.recv_request(dst, 0, timeout_s=10))
    assert isinstance(sent, kvpool.TransferRejectedError) and sent.reason == "incompatible", sent
    assert isinstance(got, kvpool.TransferRejectedError) and got.reason == "incompatible", got
    assert text in str(got), str(got)
    assert repr(dst.stats()) == before
    dst.check()


def test_every_refusal_reason_is_documented() -> None:
    """TransferRejectedError's docstring listed four of the six reasons a sender can get
    (not "malformed" or "failed"), and docs/distributed.md gave "exhausted" for every
    no-room refusal, though a full row table gives "too_many_requests"."""
    from pathlib import Path

    from kvpool.distributed import protocol

    doc = " ".join((Path(__file__).parent.parent / "docs" / "distributed.md").read_text().split())
    for reason in protocol.REASONS.values():
        assert f'"{reason}"' in kvpool.TransferRejectedError.__doc__, reason
        assert f'"{reason}"' in doc, reason


def test_a_receiver_whose_open_fails_tells_the_sender_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver whose open raised something other than a KVPoolError (a device out of
    memory writing the request's table row; injected) raised it without a reply, so the
    sender waited out its whole timeout (60 s by default). Now it is refused at once
    (reason "failed"), and the receiver's pool is as it was."""
    _links(monkeypatch)
    src = _pool(32)
    hs, _ = src.open_with_prefix(PROMPT, [len(PROMPT)])
    src.extend(hs, len(PROMPT), tokens=PROMPT)
    dst = _pool(32)

    def oom(*a: Any, **k: Any) -> None:
        raise RuntimeError("CUDA out of memory (injected)")
    monkeypatch.setattr(dst, "_write_prefixes", oom)
    before = (dst.free_pages, dst.used_pages, dst.open_requests, dst.cached_pages, dst.hit_tokens, dst.miss_tokens)
    # The loop link's receive waits 10 s for a message that never comes: the sender's timeout here.
    sent, got = _both(lambda: kv_transfer.send_request(src, int(hs[0]), 1, timeout_s=10),
                      lambda: kv_receive.recv_request(dst, 0, timeout_s=10))
    assert isinstance(got, RuntimeError) and "injected" in str(got), got
    assert isinstance(sent, kvpool.TransferRejectedError) and sent.reason == "failed", repr(sent)
    assert (dst.free_pages, dst.used_pages, dst.open_requests, dst.cached_pages, dst.hit_tokens,
            dst.miss_tokens) == before
    dst.check()
    monkeypatch.undo()
    _links(monkeypatch)
    sent, got = _both(lambda: kv_transfer.send_request(src, int(hs[0]), 1, timeout_s=10),
                      lambda: kv_receive.recv_request(dst, 0, timeout_s=10))
    assert dst.length(got) == len(PROMPT), (sent, got)
