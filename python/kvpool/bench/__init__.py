"""Host-side benchmarks: kvpool's allocator against SGLang's and vLLM's real ones.

``python -m kvpool.bench churn``  replays seeded continuous-batching traces on
every installed allocator (per-step time, ns per slot, peak metadata memory).
``python -m kvpool.bench ops``    times single SlotAllocator operations.
``python -m kvpool.bench prefix`` replays prefix-sharing traces (system prompts,
multi-turn chat, parallel sampling, a mix under memory pressure) on kvpool's
prefix cache, SGLang's RadixCache and vLLM's KVCacheManager (hit rate, µs/step).

Outputs go under the current directory or ``--out DIR``. The baselines are
optional (docs/benchmarks.md, "Installing the baselines"); missing ones are
skipped with a one-line message.
"""

from kvpool.bench.trace import Dist, Step, Trace, TraceConfig, generate

__all__ = ["Dist", "Step", "Trace", "TraceConfig", "generate"]
