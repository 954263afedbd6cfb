"""What the allocator state machine's rules (test_allocator_stateful.py and
its rule mixins) share: the prompt bases, run_both and serve_prompt."""

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
        raise AssertionError(f"model raised {type(e).__name__}, allocator succeeded") from e
    return real(), expected


def serve_prompt(machine, base, length):
    """Opens a request on BASES[base][:length] (its token ids known, so its pages
    can be cached) and prefills it, on the machine's allocator and model alike;
    returns its handle once prefilled and written, else None."""
    prompt = BASES[base][:length]
    r = run_both(lambda: machine.a.open_with_prefix(prompt, [length]),
                 lambda: machine.m.open_with_prefix([prompt], 0))
    if not r:
        return None
    h = r[1][0][0]
    machine.issued.append(h)
    machine.store.hit(machine.m, h, r[1][1][0])
    c = length - r[1][1][0]
    if not run_both(lambda: machine.a.extend([h], [c]), lambda: machine.m.extend([h], [c])):
        return None
    machine.write([h])
    return h
