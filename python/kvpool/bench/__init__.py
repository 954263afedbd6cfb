"""Host-side benchmarks: kvpool's allocator against SGLang's and vLLM's real ones.

``python -m kvpool.bench churn``  replays seeded continuous-batching traces on
every installed allocator (per-step time, ns per slot, peak metadata memory).
``python -m kvpool.bench ops``    times single SlotAllocator operations.

The baselines are optional (see the README, "Benchmarks: kvpool vs SGLang and
vLLM"); missing ones are skipped with a one-line message.
"""

from kvpool.bench.trace import Dist, Step, Trace, TraceConfig, generate

__all__ = ["Dist", "Step", "Trace", "TraceConfig", "generate"]
