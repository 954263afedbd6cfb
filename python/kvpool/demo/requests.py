"""Synthetic requests: seeded prompt and output lengths, random prompt tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


# eq=False: a request is itself, not its field values. The engine finds its requests in lists
# (running.remove(victim)); dataclass equality compared the numpy prompts, which has no truth
# value, and raised for forks that share a rid (on every Python; from 3.13 whenever the rids
# matched, as 3.13's dataclass __eq__ no longer takes the shared prompt as equal by identity).
@dataclass(eq=False)
class Request:
    rid: int
    prompt: np.ndarray          # int64 token ids
    max_new_tokens: int         # tokens to generate (the first comes from the prefill)
    output: list[int] = field(default_factory=list)
    handle: int | None = None   # kvpool handle while admitted
    row: int = -1               # its req_to_token row while admitted (pool.rows at admission)
    length: int = 0             # tokens whose K/V are in the pool (host-side mirror)
    # Filled only when the engine records (tests): logits of every position, and
    # every slot the request ever held.
    logits: list[torch.Tensor] = field(default_factory=list)
    slots_seen: set[int] = field(default_factory=set)

    @property
    def final_length(self) -> int:
        """Tokens in the pool when done: the last generated token is never fed back."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    def reset(self) -> None:
        """Forget progress (after preemption the request is recomputed from scratch)."""
        self.output.clear()
        self.logits.clear()
        self.handle = None
        self.row = -1
        self.length = 0

    def all_tokens(self) -> torch.Tensor:
        """Prompt followed by the generated tokens that were fed back to the model."""
        fed = self.output[: max(0, self.max_new_tokens - 1)]
        return torch.tensor(np.concatenate([self.prompt, np.asarray(fed, dtype=np.int64)]))


def synthetic_requests(
    n: int,
    *,
    vocab_size: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[Request]:
    """``n`` requests with lengths uniform in the inclusive ranges, reproducible from ``seed``."""
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= min <= max, got {lo}..{hi}")
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_len[0], prompt_len[1] + 1, size=n)
    output_lens = rng.integers(output_len[0], output_len[1] + 1, size=n)
    return [
        Request(rid=i, prompt=rng.integers(0, vocab_size, size=int(p), dtype=np.int64),
                max_new_tokens=int(o))
        for i, (p, o) in enumerate(zip(prompt_lens, output_lens))
    ]
