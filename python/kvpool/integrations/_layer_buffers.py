"""A batch's layer buffers (``KVPoolCache``'s copy of its rows' K/V, see ``_pages``), the views
into them, and the spares a pool keeps for its next caches.

A decode step hands attention two views per layer and adds its token through two more.
Making a tensor and freeing it costs about a microsecond of host time; on a small model
those views were most of the cache's own host time per token, made anew for every step of
every ``generate``. A view of the buffers depends only on their geometry (rows, capacity)
and on the tokens it covers, never on the pool's pages, so a set of buffers keeps the views
it has made (``attention``, ``tokens``, and ``decode``: both for a deferred step; and ``plans``,
``StepPages``' plans of a page's deferred steps, which are made of those; ``span``, the
tokens a flush stores; and ``prompt``, a prompt step's, for a few lengths), and a closed
cache (or one whose buffers grew or changed rows) leaves its set to the pool's next cache of
the same rows that fits in it (``BufferSpares``: the one with the least room), as torch's
caching allocator keeps a freed block for the next request it fits. The views are made under
``persistent()``, so a set made under one grad mode serves a cache under any other.

The spares are bounded: the views' host time shows on small models and short contexts,
whose buffers are small (a large model spends far more per token in its layers), so a set is
kept only while it is at most 64 MiB, and a pool keeps at most four (the oldest is dropped
first): a server alternating a few batch sizes finds each one's. ``release_buffers(pool)``
frees them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from kvpool._forksafe import INNER
from kvpool._forksafe import track as track_for_fork
from kvpool.modes import persistent
from kvpool.streams import capturing, current_raw_stream  # (capturing: of t's device)

# A set keeps the views it made while there are at most this many (a tensor object is a few
# hundred bytes): every view of a small model's buffers, not those of a long context on many
# layers, whose per-token model time dwarfs the views' anyway.
MAX_KEPT_VIEWS = 1 << 14
# The multi-token steps (prompts) whose views a set keeps: a server's few common prompt lengths.
MAX_KEPT_PROMPTS = 16


def allocated_on(t: torch.Tensor) -> set[Any]:
    """The streams torch's caching allocator knows ``t`` (just made) is used on: the current
    stream of its device, which it was allocated on; none on the CPU."""
    return {torch.cuda.current_stream(t.device)} if t.is_cuda else set()


def _used_on(t: torch.Tensor, stream: Any, streams: set[Any] | None) -> None:
    # A spare moves between caches, so it may be used on a stream other than the one it was
    # allocated on. Freed later (dropped from the spares, outgrown, release_buffers), torch's
    # caching allocator would hand its memory at once to the next tensor made on the
    # allocating stream, while work queued on the other stream may still read or write it.
    # record_stream (what torch asks of a tensor used on a side stream) makes the allocator
    # wait for that stream's work at the free; it is sticky, so each stream is marked once
    # per spare, and never on the common path of caches that all run on one stream.
    if streams is not None and stream not in streams:
        t.record_stream(stream)
        streams.add(stream)


def stream_mark(t: torch.Tensor, streams: set[Any] | None = None) -> Any:
    """An event recorded on the current stream of ``t``'s device after the work queued on it
    so far, or None on the CPU (or while that stream is captured). With ``streams`` (those
    ``t`` is marked as used on, ``allocated_on``), that stream is marked too when new."""
    if not t.is_cuda or capturing(t.device):
        return None
    stream = torch.cuda.current_stream(t.device)
    _used_on(t, stream, streams)
    event = torch.cuda.Event()
    event.record(stream)
    return event


def stream_wait(t: torch.Tensor, event: Any, streams: set[Any] | None = None) -> None:
    """The current stream of ``t``'s device waits for ``event`` (from ``stream_mark``); with
    ``streams``, that stream is marked as used on ``t`` when new (see ``stream_mark``)."""
    if event is not None:
        stream = torch.cuda.current_stream(t.device)
        stream.wait_event(event)
        _used_on(t, stream, streams)


def follow_stream(device: torch.device, raw: int) -> None:
    """``device``'s current stream waits for the stream whose raw handle is ``raw`` (the one
    a cache's steps wrote the layer buffers on), unless it is that stream: a flush called from
    another stream must not read the buffers before those steps' copies have run."""
    if current_raw_stream(device) != raw:
        torch.cuda.current_stream(device).wait_stream(torch.cuda.ExternalStream(raw, device=device))


def reusable(t: torch.Tensor) -> bool:
    """Whether a spare on ``t``'s device may be taken now: not into a graph being captured."""
    return not (t.is_cuda and capturing(t.device))


class LayerBuffers:
    """Per layer, K and V of ``b`` rows with room for ``cap`` tokens: ``buf`` is ``[2 (K, V),
    layers, B, H, cap, D]``, ``both`` the same as ``[2 * layers, B, H, cap, D]``."""

    def __init__(self, like: torch.Tensor, layers: int, b: int, h: int, cap: int, d: int) -> None:
        with persistent():  # written under any grad mode, inference mode included
            flat = torch.empty(2 * layers * b * h * cap * d, dtype=like.dtype, device=like.device)
        self.layers, self.b, self.h, self.cap, self.d = layers, b, h, cap, d
        self.buf = flat.view(2, layers, b, h, cap, d)
        self.both = flat.view(2 * layers, b, h, cap, d)
        self.nbytes = flat.numel() * flat.element_size()
        self.keep = 2 * cap * 2 * layers <= MAX_KEPT_VIEWS
        self._attention: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._tokens: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._decode: dict[int, list[tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]] = {}
        # ``StepPages``' deferred plans made of these views, by (tokens, steps), kept with them (``keep``).
        self.plans: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._spans: dict[tuple[int, int], torch.Tensor] = {}
        self._prompts: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.fence: Any = None  # set while a spare: what its last cache queued (``stream_mark``)
        self.streams = allocated_on(flat)  # the streams the allocator knows it is used on

    def views(self, first: int, t: int, steps: int = 0) -> Any:
        """Per layer (k, v) ``[B, H, t, D]`` views from token ``first``; with ``steps``, a list of
        those for ``steps`` decode steps (``t`` 1) that follow. Made anew at each call."""
        both, layers = self.both, self.layers
        size, stride = both.shape[:-2] + (t, self.d), both.stride()
        at = both.storage_offset() + first * self.d
        if not steps:
            one = both.as_strided(size, stride, at)
            views = one.unbind(0)
            return list(zip(views[:layers], views[layers:]))
        out = []
        ones = both.as_strided((steps,) + size, (self.d,) + stride, at).unbind(0)
        for one in ones:
            views = one.unbind(0)
            out.append(list(zip(views[:layers], views[layers:])))
        return out

    def prompt(self, first: int, t: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``views(first, t)``: per layer (k, v) of a step's ``t`` tokens from token ``first``
        (a prompt's), kept with ``keep`` for up to ``MAX_KEPT_PROMPTS`` such steps, which the
        next caches' prompts of those lengths take."""
        got = self._prompts.get((first, t))
        if got is None:
            if not (self.keep and len(self._prompts) < MAX_KEPT_PROMPTS):
                return self.views(first, t)  # type: ignore[no-any-return]
            with persistent():
                got = self._prompts[first, t] = self.views(first, t)
        return got

    def span(self, first: int, n: int) -> torch.Tensor:
        """Every layer's K and V of tokens ``first`` to ``first + n``, ``[2 * layers, B, H, n, D]``:
        what a flush stores (kept, with ``keep``, for the flushes of the next caches)."""
        got = self._spans.get((first, n))
        if got is None:
            if not (self.keep and len(self._spans) < self.cap):
                return self.both[:, :, :, first : first + n]
            with persistent():
                got = self._spans[first, n] = self.both[:, :, :, first : first + n]
        return got

    def attention(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) of the rows' first ``n`` tokens: what attention reads."""
        got = self._attention.get(n)
        if got is None:
            if not self.keep:
                return self.views(0, n)
            with persistent():
                got = self._attention[n] = self.views(0, n)
        return got

    def tokens(self, first: int, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per decode step from token ``first`` on (``steps`` of them), per layer (k, v) of that
        step's one token: where each layer adds it."""
        if not self.keep:
            return self.views(first, 1, steps=steps)
        cached = self._tokens
        try:
            return [cached[first + i] for i in range(steps)]
        except KeyError:
            with persistent():
                for i, pairs in enumerate(self.views(first, 1, steps=steps)):
                    cached.setdefault(first + i, pairs)
            return [cached[first + i] for i in range(steps)]

    def decode(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
        """Per layer, for the decode step that brings the rows to ``n`` tokens: where it adds
        its token's K and V, and what attention then reads (``tokens`` and ``attention`` in one
        tuple, so a deferred step's ``update`` takes both with one lookup)."""
        got = self._decode.get(n)
        if got is None:
            got = [(dk, dv, kv) for (dk, dv), kv in zip(self.tokens(n - 1, 1)[0], self.attention(n))]
            if self.keep:
                self._decode[n] = got
        return got


class BufferSpares:
    """Layer buffers of closed caches, for the pool's next caches of the same rows that fit in
    them (see the module doc for the bounds)."""

    def __init__(self, most_bytes: int = 64 << 20, most_sets: int = 4) -> None:
        self.most_bytes, self.most_sets = most_bytes, most_sets
        self._sets: OrderedDict[tuple[int, int], LayerBuffers] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # caches on several threads share their pool's spares
        track_for_fork(self, "_lock", INNER)  # a forked child's first cache would wait on it

    def take(self, b: int, need: int, like: torch.Tensor) -> LayerBuffers | None:
        """The spare of ``b`` rows with the least room that holds ``need`` tokens, or None; the
        current stream of ``like``'s device waits for what its last cache queued."""
        if not reusable(like):
            return None
        with self._lock:
            fits = [key for key in self._sets if key[0] == b and key[1] >= need]
            if not fits:
                return None
            got = self._sets.pop(min(fits, key=lambda key: key[1]))
            self._bytes -= got.nbytes
        stream_wait(got.buf, got.fence, got.streams)
        got.fence = None
        return got

    def give(self, buffers: LayerBuffers) -> None:
        # A stream being captured records no fence: a set given back then is dropped, as the
        # next cache (on any stream) would otherwise take it with nothing to wait on.
        if buffers.nbytes > self.most_bytes or not reusable(buffers.buf):
            return
        buffers.fence = stream_mark(buffers.buf, buffers.streams)
        with self._lock:
            old = self._sets.pop((buffers.b, buffers.cap), None)
            if old is not None:
                self._bytes -= old.nbytes
            self._sets[(buffers.b, buffers.cap)] = buffers
            self._bytes += buffers.nbytes
            while len(self._sets) > self.most_sets:
                _, dropped = self._sets.popitem(last=False)
                self._bytes -= dropped.nbytes

    def clear(self) -> None:
        with self._lock:
            self._sets.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes the spares hold."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._sets)
