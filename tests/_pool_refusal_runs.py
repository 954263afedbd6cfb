"""How the torch pool's refusal tests drive ``PoolRefusalMachine`` (tests/_pool_refusal_machine.py):
the prepared state every catalogue entry can use, the hypothesis run, and the sweep of every entry,
for the plain pool's tests and the hybrid pool's."""

from __future__ import annotations

from _pool_refusal_machine import BASES, SETTINGS, STATS, Config, PoolRefusalMachine
from pool_refusal_catalogue import FLAKY


def prepared(cfg: Config) -> PoolRefusalMachine:
    """A machine in a state every catalogue entry can use: live requests with and
    without prompts, a cached chain, a shared (forked) page, written K/V, a closed
    handle whose row was reopened, and a recent ExtendResult of the pool's own."""
    m = PoolRefusalMachine()
    m._setup(cfg)
    prompt = BASES[0][: m.max_ctx - 2]
    r, _ = m.both(lambda p: p.open_with_prefix(prompt, [len(prompt)]))
    m.opened(r[0], prompts=[prompt])
    h = int(r[0][0])
    ra, rt = m.both(lambda p: p.extend([h], len(prompt)))
    m.write_new([h], {}, ra, rt, "loc")
    return finish_prepared(m, h, prompt)


def finish_prepared(m: PoolRefusalMachine, h: int, prompt: list[int]) -> PoolRefusalMachine:
    """The rest of a prepared state (the hybrid machine's too), after request ``h`` of
    ``prompt`` was written: ``h`` closed to the cache and its row taken back (a stale
    handle), a prefix hit on ``prompt``, both live requests extended, one forked."""
    m.both(lambda p: p.close([h], cache=True))
    m.closed_now([h])
    m.opened(m.both(lambda p: p.open(1))[0])  # takes the closed row back: the closed handle is now stale
    q = prompt[:-2] + [0, 1, 2]
    r, _ = m.both(lambda p: p.open_with_prefix(q, [len(q)]))
    m.opened(r[0], prompts=[q])
    before = m.lengths()
    ra, rt = m.both(lambda p: p.extend(m.live, [3, 1]))
    m.write_new(list(m.live), before, ra, rt, "loc")
    f, _ = m.both(lambda p: p.fork(m.live[1], 1))
    m.opened(f, tag_from=m.live[1])
    m.twins_agree()
    return m


def run_machine(machine: type[PoolRefusalMachine]) -> None:
    """Runs ``machine`` under SETTINGS, and fails if it reached too few bad calls or unusual
    forms to say anything (hypothesis may draw mostly valid calls)."""
    STATS.update(bad=0, odd=0)
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
    assert STATS["bad"] > 500, f"only {STATS['bad']} bad calls ran: the machine is not reaching them"
    assert STATS["odd"] > 100, f"only {STATS['odd']} unusual forms were accepted"


def sweep(prepare) -> None:
    """Each catalogue entry once, from the state ``prepare()`` makes, against the first and then
    the last live handle, each time under another grad mode; then each __index__ form that
    answers once or twice. Every failing entry is named at once (a fresh state after one)."""
    failures = []
    for which, mode in ((0, "grad"), (-1, "no_grad"), (0, "inference")):
        m, ran = prepare(), []
        for name, make in m.BAD:
            try:
                if m.refuse(name, make, lambda xs, w=which: xs[w], mode):
                    ran.append(name)
            except AssertionError as e:
                failures.append(str(e).splitlines()[0][:300])
                ran.append(name)
                m = prepare()
        skipped = sorted({name for name, _ in m.BAD} - set(ran) - m.NOT_HERE)
        assert not skipped, f"entries that found no state to run in: {skipped}"
    for ok in (1, 2):
        for name, call in FLAKY:
            m = prepare()
            try:
                m.same_or_refused(name, call, m.live[-1], ok, "grad")
            except AssertionError as e:
                failures.append(str(e).splitlines()[0][:300])
    assert not failures, "\n".join(failures)
