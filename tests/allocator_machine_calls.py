"""What the allocator state machine's rules (test_allocator_stateful.py and
its rule mixins) share: the prompt bases and run_both."""

import kvpool

#: Two prompt bases sharing their first 4 tokens, over a 3-letter alphabet so
#: that decode tokens often repeat a cached prefix.
BASES = [[1, 2, 1, 0, 2, 2, 1, 0, 0, 1, 2, 0, 1, 1, 2, 0, 1, 2, 2, 1, 0],
         [1, 2, 1, 0, 0, 0, 2, 1, 2, 2, 0, 1, 0, 2, 1, 1, 0, 0, 2, 1, 1]]


def run_both(real, model):
    """Runs both calls; they must both succeed (returning results) or raise the same type."""
    try:
        expected = model()
    except kvpool.KVPoolError as e:
        try:
            real()
        except kvpool.KVPoolError as got:
            assert type(got) is type(e), f"allocator raised {got!r}, model {type(e).__name__}"
            return None
        raise AssertionError(f"model raised {type(e).__name__}, allocator succeeded")
    return real(), expected
