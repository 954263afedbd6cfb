"""One KVPool driven the way an overlapped engine drives it: a scheduler thread
and a model thread at once.

The scheduler thread runs step N+1's bookkeeping (``admit``, ``open_with_prefix``,
``extend``, ``fork``, ``truncate``, ``close``, ``cache``, ``evict``) while the model
thread writes and reads step N's K/V (``write``, ``read``, ``gather_kv`` on the
layer views, ``req_to_token`` rows); a third thread polls the counters,
``page_table`` and ``check()``. The scheduler keeps the orderings the pool's
docs leave to the caller: a request the model thread has not finished with is
only extended (never forked, truncated, cached or closed), and two threads never
extend one request.

A model's K/V at a position depends on the whole token prefix, so here every
position stores a value computed from its request's tokens up to it: a prefix
hit, a fork and a copy-on-write copy all have one right answer, which the model
thread checks for every request of every step, bitwise, in every layer, and the
main thread checks again for every open request after joining.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

import numpy as np
import pytest
import torch

import kvpool
from kvpool import ContextTooLongError, PoolExhaustedError, TooManyRequestsError
from kvpool.kernels import gather_kv

LAYERS, HEADS, DIM = 2, 2, 3
MAX_CTX = 96
STEPS = 160
JOIN_S = 20.0
SWITCH_S = 2e-5  # hand the GIL over inside pool calls, not every 5 ms


def chain_values(tokens: list[int]) -> list[float]:
    """Position i's value: a hash of tokens[:i+1], exact in float32 (below 2^22)."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1000003 + t + 1) % (1 << 21)
        out.append(float(h) + 0.5)
    return out


def kv_rows(values: list[float], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows [n, HEADS, DIM] for these position values in ``layer`` (exact)."""
    base = torch.tensor(values, dtype=torch.float32).view(-1, 1, 1) + float(layer << 21)
    k = base + torch.arange(HEADS * DIM, dtype=torch.float32).view(1, HEADS, DIM) * (1 << 22)
    return k, -k


class Step:
    """What the scheduler hands the model thread: each request's new slots and the
    values its whole sequence must read back once they are written."""

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self.items: list[tuple[int, int, np.ndarray, np.ndarray, list[float]]] = []  # h, row, all slots, new, want

    def add(self, pool: kvpool.KVPool, h: int, new: np.ndarray, tokens: list[int]) -> None:
        self.items.append((h, int(pool.rows([h])[0]), pool.slots(h), new, chain_values(tokens)))


class Scheduler:
    def __init__(self, pool: kvpool.KVPool, steps: queue.Queue, done: list[int], seed: int) -> None:
        self.pool, self.steps, self.done = pool, steps, done
        self.rng = np.random.default_rng(seed)
        self.tokens: dict[int, list[int]] = {}  # open request -> its token ids
        self.busy: dict[int, int] = {}  # request -> last step serial that holds it
        self.serial = 0
        self.prompts = [list(self.rng.integers(0, 50, size=MAX_CTX // 2)) for _ in range(3)]
        self.counts = {"forks": 0, "hits": 0, "cow_steps": 0, "closes": 0, "evicted": 0}
        self.open_now: tuple[int, ...] = ()  # for the observer: replaced whole, never mutated

    def idle(self, h: int) -> bool:
        return self.busy.get(h, -1) <= self.done[0]

    def idle_requests(self) -> list[int]:
        return [h for h in self.tokens if self.idle(h)]

    def send(self, step: Step) -> None:
        for h, *_ in step.items:
            self.busy[h] = step.serial
        self.steps.put(step, timeout=JOIN_S)

    def new_step(self) -> Step:
        self.serial += 1
        return Step(self.serial)

    def drop(self, h: int, cache: bool) -> None:
        self.pool.close([h], cache=cache)
        del self.tokens[h]
        self.busy.pop(h, None)
        self.counts["closes"] += 1

    def make_room(self) -> None:
        idle = self.idle_requests()
        if idle:
            self.drop(idle[int(self.rng.integers(len(idle)))], cache=bool(self.rng.random() < 0.5))
        else:
            time.sleep(0.001)  # everything is in flight: let the model thread finish a step

    def op(self) -> None:
        pool, rng = self.pool, self.rng
        r = rng.random()
        if r < 0.35 and self.tokens:
            # Decode: in-flight requests too (the next step's slots while this one runs).
            batch = [h for h in self.tokens if len(self.tokens[h]) < MAX_CTX - 4 and rng.random() < 0.6]
            if not batch:
                return
            toks = [int(t) for t in rng.integers(0, 50, size=len(batch))]
            copied = pool.copied_slots
            res = pool.extend(np.array(batch, dtype=np.int64), 1, tokens=toks)
            self.counts["cow_steps"] += pool.copied_slots > copied
            step = self.new_step()
            for i, (h, t) in enumerate(zip(batch, toks)):
                self.tokens[h].append(t)
                step.add(pool, h, res.slots[i : i + 1], self.tokens[h])
            self.send(step)
        elif r < 0.55:
            # A new prompt: a shared system prompt plus its own tail, on its cached prefix.
            base = self.prompts[int(rng.integers(len(self.prompts)))]
            prompt = base[: int(rng.integers(4, len(base)))] + [int(t) for t in rng.integers(0, 50, size=3)]
            if rng.random() < 0.3:
                hs, res = pool.admit([len(prompt)], tokens=prompt)
                h = int(hs[0])
            else:
                hs, cached = pool.open_with_prefix(prompt, [len(prompt)])
                h, cached = int(hs[0]), int(cached[0])
                self.counts["hits"] += cached > 0
                try:
                    res = pool.extend([h], [len(prompt) - cached])
                except PoolExhaustedError:
                    pool.close([h])  # not the scheduler's yet: give its cached pages back
                    raise
            self.tokens[h] = list(prompt)
            step = self.new_step()
            step.add(pool, h, res.slots, prompt)
            self.send(step)
        elif r < 0.67:
            idle = self.idle_requests()
            if idle and len(self.tokens) < pool.max_requests - 2:
                src = idle[int(rng.integers(len(idle)))]
                for kid in pool.fork(src, int(rng.integers(1, 3))):
                    self.tokens[int(kid)] = list(self.tokens[src])
                self.counts["forks"] += 1
        elif r < 0.75:
            idle = [h for h in self.idle_requests() if len(self.tokens[h]) > 1]
            if idle:
                h = idle[int(rng.integers(len(idle)))]
                keep = int(rng.integers(1, len(self.tokens[h])))
                pool.truncate([h], [keep])
                del self.tokens[h][keep:]
        elif r < 0.87:
            idle = self.idle_requests()
            if idle:
                self.drop(idle[int(rng.integers(len(idle)))], cache=bool(rng.random() < 0.6))
        elif r < 0.95:
            idle = self.idle_requests()
            if idle:
                pool.cache([idle[int(rng.integers(len(idle)))]])
        else:
            self.counts["evicted"] += pool.evict(int(rng.integers(1, 4)))

    def run(self, stop: threading.Event) -> None:
        try:
            while self.serial < STEPS and not stop.is_set():
                try:
                    self.op()
                except (PoolExhaustedError, TooManyRequestsError, ContextTooLongError):
                    self.make_room()  # refusals are atomic: nothing changed
                self.open_now = tuple(self.tokens)
        finally:
            self.steps.put(None, timeout=JOIN_S)


def check_request(pool: kvpool.KVPool, h: int, row: int, slots: np.ndarray, want: list[float],
                  where: str) -> None:
    assert len(slots) == len(want), f"{where}: request {h:#x} holds {len(slots)} slots, {len(want)} tokens"
    table = pool.req_to_token[row, : len(slots)].numpy()
    assert np.array_equal(table, slots), f"{where}: req_to_token row of {h:#x} differs from its slots"
    idx = torch.from_numpy(slots)
    for layer in range(LAYERS):
        wk, wv = kv_rows(want, layer)
        k, v = pool.read(layer, slots)
        gk, gv = gather_kv(pool.k_buffer(layer), pool.v_buffer(layer), idx)
        for name, got in (("read K", k), ("gather K", gk), ("read V", -v), ("gather V", -gv)):
            if not torch.equal(got, wk):
                bad = int(torch.nonzero((got != wk).any(-1).any(-1))[0, 0])
                raise AssertionError(f"{where}: {name} of request {h:#x} layer {layer} position {bad} "
                                     f"(slot {int(slots[bad])}) is {got[bad, 0, 0].item()}, "
                                     f"expected {wk[bad, 0, 0].item()}")


def model(pool: kvpool.KVPool, steps: queue.Queue, done: list[int]) -> None:
    while True:
        step = steps.get(timeout=JOIN_S)
        if step is None:
            return
        for layer in range(LAYERS):
            for _h, _row, _slots, new, want in step.items:
                if len(new):
                    k, v = kv_rows(want[len(want) - len(new) :], layer)
                    pool.write(layer, new, k, v, strict=True)
        for h, row, slots, _new, want in step.items:
            check_request(pool, h, row, slots, want, f"step {step.serial}")
        done[0] = step.serial


def observer(pool: kvpool.KVPool, sched: Scheduler, stop: threading.Event, polls: list[int]) -> None:
    while not stop.is_set():
        s = pool.stats()
        assert s.free_pages + s.used_pages == pool.capacity_pages, s  # a snapshot under one lock
        pool.check()
        hs = sched.open_now[:4]
        try:
            pt = pool.page_table(np.array(hs, dtype=np.int64))
            assert pt.kv_indptr.shape[0] == len(hs) + 1
        except kvpool.InvalidHandleError:
            pass  # the scheduler closed one meanwhile
        polls[0] += 1
        time.sleep(0.0005)


@pytest.mark.parametrize(
    "page_size,layout,device_path",
    [(1, "token", False), (16, "paged", False), (1, "paged", True), (16, "token", True)],
    ids=["p1-token", "p16-paged", "p1-paged-device-path", "p16-token-device-path"],
)
def test_scheduler_and_model_threads_keep_every_request_bitwise(page_size, layout, device_path):
    pool = kvpool.KVPool(LAYERS, HEADS, DIM, dtype=torch.float32, page_size=page_size,
                         num_slots=384 if page_size == 1 else 512, max_requests=16,
                         max_context_len=MAX_CTX, layout=layout, hash_seed=7, handle_seed=7)
    if device_path:
        pool._table_np = None  # CUDA's path on CPU: extend_packed, then the table written by torch
    steps: queue.Queue = queue.Queue(maxsize=2)  # the scheduler runs at most two steps ahead
    done = [0]
    sched = Scheduler(pool, steps, done, seed=page_size * 10 + device_path)
    stop = threading.Event()
    errors: list[BaseException] = []
    polls = [0]

    def guarded(fn, *args):
        def run():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - surfaced in the main thread
                errors.append(e)
                stop.set()
        return threading.Thread(target=run)

    threads = [guarded(sched.run, stop), guarded(model, pool, steps, done), guarded(observer, pool, sched, stop, polls)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    try:
        for t in threads:
            t.start()
        for t in threads[:2]:
            t.join(JOIN_S)
        stop.set()
        threads[2].join(JOIN_S)
        assert not any(t.is_alive() for t in threads), "a thread hung"
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    assert done[0] == STEPS, done
    c = sched.counts
    assert c["forks"] >= 5 and c["hits"] >= 5 and c["closes"] >= 5, c
    assert page_size == 1 or c["cow_steps"] >= 2, c  # one-slot pages are never partly filled
    assert polls[0] > 0
    for h, toks in sched.tokens.items():
        check_request(pool, h, int(pool.rows([h])[0]), pool.slots(h), chain_values(toks), "after join")
    pool.check()
    pool.close(np.array(list(sched.tokens), dtype=np.int64))
    pool.clear_cache()
    assert pool.free_pages == pool.capacity_pages
    pool.check()
