"""Host-side benchmarks: kvpool's allocator against SGLang's and vLLM's real ones.

``python -m kvpool.bench churn``  replays seeded continuous-batching traces on
every installed allocator (per-step time, ns per slot, peak metadata memory).
``python -m kvpool.bench ops``    times single SlotAllocator operations.
``python -m kvpool.bench overhead`` times what the torch layer adds on the host:
write/read over bare copies, KVPoolCache against DynamicCache, a fresh pool's
first burst.
``python -m kvpool.bench prefix`` replays prefix-sharing traces (system prompts,
multi-turn chat, parallel sampling, a mix under memory pressure) on kvpool's
prefix cache, SGLang's RadixCache and vLLM's KVCacheManager (hit rate, µs/step).

Outputs go under the current directory or ``--out DIR``. The baselines are
optional (docs/benchmarks.md, "Installing the baselines"); missing ones are
skipped with a one-line message.

One framework serves every replayed workload (``churn``, ``prefix``):

- ``workload.py``: what a workload declares (its flags, the traces it replays, its
  result row, table columns, ratios and plot panels); each workload is a package
  (``churn/``, ``prefix/``) with its trace generator, result row and figures.
- ``drivers/``: the one registry, (workload, allocator) -> driver class, imported lazily.
- ``runner.py``: the timing loop and the replay of one trace on one driver.
- ``command.py``: the cases of a run, replayed in passes, repeats, the median.
- ``report.py`` and ``plot.py``: table, JSON and plot for any workload.
"""
