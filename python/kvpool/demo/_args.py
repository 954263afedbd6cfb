"""The demo's flags checked before anything is built: each value as argparse parses it
(``type=`` of ``build_parser``), then the settings together against this machine's memory
and kvpool's allocator bounds, each refusal naming the flag to change."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

import torch


def _range(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        pair = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX (e.g. 32:256), got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return pair


def _path(text: str) -> str:
    if not text.strip():  # else "--json ''" would quietly mean "not given"
        raise argparse.ArgumentTypeError("expected a path, got an empty one")
    return text


def _int_at_least(text: str, low: int, expected: str) -> int:
    """``int(text)`` if it is at least ``low``, else argparse's error saying what was expected
    (for a non-number, argparse's own message would name this module's function: "invalid
    _positive value: 'abc'")."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _positive(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _non_negative(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _seed(text: str) -> int:
    value = _non_negative(text)
    if value >= 1 << 63:  # torch's generator takes an int64 seed
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63), got {text!r}")
    return value


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N] (the devices a KVPool lives on), got {text!r}")
    return text


def _threads(text: str) -> int:
    value = _positive(text)
    cores = os.cpu_count() or 1
    if value > cores:
        # More would only oversubscribe, and torch crashes outright on tens of thousands.
        raise argparse.ArgumentTypeError(f"expected at most {cores} (this machine's CPU count), got {text!r}")
    return value


# Lower bounds of the host bytes one synthetic request, and one system prompt, hold besides
# their token ids (measured: about 630 and 110 bytes with CPython 3.12 and numpy 2).
REQUEST_BYTES, SYSTEM_PROMPT_BYTES = 512, 96


def host_memory_bytes() -> int:
    """This machine's physical memory: what no setting may need more of."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def model_bytes(cfg: Any, dtype: torch.dtype) -> int:
    """Bytes of the random model's weights in ``dtype`` plus its float32 rotary tables."""
    h, q, kv, ffn = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn
    per_layer = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * ffn  # two norms, q k v o, the MLP
    weights = 2 * cfg.vocab_size * h + cfg.layers * per_layer + h  # embedding, LM head, final norm
    return weights * dtype.itemsize + 2 * cfg.max_positions * (cfg.head_dim // 2) * 4


def _check_request_memory(args: argparse.Namespace, usage_error: Callable[[str], Any] | None) -> None:
    """Refuse, before generating any, requests that cannot fit in this machine's memory (a
    billion of them would otherwise take hours to generate, then more memory than there is)."""
    need = args.requests * (REQUEST_BYTES + 8 * args.prompt_len[0])
    flags = "--requests"
    if args.workload == "shared-prefix":
        need += args.system_prompts * (SYSTEM_PROMPT_BYTES + 8 * args.system_len[0])
        flags = "--requests or --system-prompts"
    have = host_memory_bytes()
    if need > have:
        message = (f"{args.requests} requests need at least {need} bytes of host memory, more than this "
                   f"machine's {have}; lower {flags}")
        if usage_error is None:
            raise ValueError(message)
        usage_error(message)


def _check_allocator_bounds(args: argparse.Namespace, max_ctx: int, usage_error: Callable[[str], Any] | None) -> None:
    """The allocator's bounds (kvpool._core) by the flag that sets each: the core's own complaint
    names its parameter (max_requests, max_context_len), not the demo's flag."""
    from kvpool._core import MAX_CONTEXT_LEN, MAX_PAGES, MAX_REQUESTS

    lengths = "--system-len, --prompt-len and --output-len" if args.workload == "shared-prefix" else \
        "--prompt-len and --output-len"
    message = None
    if args.max_running > MAX_REQUESTS:
        message = f"--max-running {args.max_running} is more than kvpool's allocator takes; give it in [1, {MAX_REQUESTS}]"
    elif args.page_size > MAX_CONTEXT_LEN:
        message = (f"--page-size {args.page_size} is longer than the longest request kvpool's allocator takes "
                   f"({MAX_CONTEXT_LEN} tokens); give a page size in [1, {MAX_CONTEXT_LEN}] (1 to 256 is usual)")
    elif max_ctx > MAX_CONTEXT_LEN:
        message = (f"{lengths} make requests of up to {max_ctx} tokens (whole pages of --page-size "
                   f"{args.page_size}); kvpool's allocator takes at most {MAX_CONTEXT_LEN}: give shorter lengths")
    elif -(-args.pool_tokens // args.page_size) + 1 > MAX_PAGES:
        message = (f"--pool-tokens {args.pool_tokens} is more than {MAX_PAGES} pages of --page-size "
                   f"{args.page_size} (page 0 included), what kvpool's allocator takes: give fewer")
    elif args.host_pages == 1:  # (the pool's own refusal names its parameter, host_pages)
        message = (f"--host-pages 1 is a host tier of only its reserved page 0; give 0 (no host tier) or "
                   f"a number in [2, {MAX_PAGES}]")
    elif args.host_pages > MAX_PAGES:
        message = (f"--host-pages {args.host_pages} is more than kvpool's allocator takes; give 0 (no host tier) or "
                   f"a number in [2, {MAX_PAGES}]")
    elif max_ctx > -(-args.pool_tokens // args.page_size) * args.page_size:
        # Checked before anything is built: the request table and the prompts of such lengths
        # (a 1e8-token --prompt-len) each passed the memory check alone and together filled
        # the machine, and the engine would refuse the requests only after all that.
        message = (f"{lengths} make requests of up to {max_ctx} tokens, more than the pool's --pool-tokens "
                   f"{args.pool_tokens} holds: enlarge the pool or shorten the requests")
    if message is None:
        return
    if usage_error is None:
        raise ValueError(message)
    usage_error(message)
