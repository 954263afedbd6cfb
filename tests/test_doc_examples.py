"""Every ```python block of README.md and docs/*.md runs, on CPU, and does what its prose says.

Each block runs as the doc shows it, compiled under the doc's file name and line
numbers, in a fresh namespace, between a setup and a check (tests/_doc_cases.py
says what each supplies and asserts, and how a GPU-sized block becomes a CPU one).

Continuations, decided per file: a block marked ``after`` runs in the namespace
its file's previous block left (tiers.md's host storage, page moves and transfer
runner; hybrid.md's calls on the pool built just before; grad-modes.md's audit of
that pool). Every other block stands alone, README.md's included: its fragments
get their context from their setup. Blocks for two instances (distributed.md,
README's P/D lines) run on two gloo ranks, all in one spawn.

Blocks that cannot run here are listed in tests/_doc_cases_*.py with the reason and
skipped with it; a block that has no case fails ``test_every_block_has_a_case``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _doc_blocks as D  # noqa: E402
from _doc_cases import Case  # noqa: E402
from _doc_cases_docs import CASES as DOCS_CASES  # noqa: E402
from _doc_cases_readme import CASES as README_CASES  # noqa: E402

CASES: dict[str, list[Case]] = {**README_CASES, **DOCS_CASES}

TESTS = str(Path(__file__).parent)


def _rel(path: Path) -> str:
    return path.relative_to(D.ROOT).as_posix()


BLOCKS = {_rel(p): D.blocks(p) for p in D.DOCS}
IDS = [(f, i) for f in CASES for i in range(len(CASES[f]))]


def test_every_block_has_a_case():
    with_code = {f: len(b) for f, b in BLOCKS.items() if b}
    assert with_code == {f: len(c) for f, c in CASES.items()}, "a doc gained or lost a ```python block"
    for f, cases in CASES.items():
        for i, (case, (line, code)) in enumerate(zip(cases, BLOCKS[f])):
            assert code.splitlines()[0].startswith(case.first), f"{f}:{line}: block {i} is not the one its case is for"
            assert not (case.after and i == 0), f"{f}: the first block continues nothing"


def _steps(f: str, i: int) -> list[dict[str, Any]]:
    """The steps of block ``i`` of ``f``, after those of the blocks it continues."""
    case: Case = CASES[f][i]
    line, code = BLOCKS[f][i]
    where = f"{f}:{line}"
    code = D.substitute(code, case.subs, where)
    steps = _steps(f, i - 1) if case.after else []
    steps = [s for s in steps if s["kind"] != "check"]  # an earlier block's check may consume its state
    if case.setup:
        steps.append(dict(kind="setup", file=f"<setup of {where}>", line=1, code=case.setup, keep=case.modules))
    steps.append(dict(kind="block", file=f, line=line, code=code, keep=()))
    if case.check:
        # The check is the test's code: it imports what it uses, whatever the block did.
        check = "import numpy as np, torch, kvpool\n" + case.check.lstrip("\n")
        steps.append(dict(kind="check", file=f"<check of {where}>", line=1, code=check, keep=()))
    if case.cleanup:
        steps.append(dict(kind="cleanup", file=f"<cleanup of {where}>", line=1, code=case.cleanup, keep=()))
    return steps


def _ns() -> dict[str, Any]:
    return {"__name__": "__doc_example__", "pytest": pytest, "TESTS": TESTS}


@pytest.fixture(scope="module")
def rank_results() -> list[dict[str, str | None]]:
    import _dist

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    cases = {f"{f}#{i}": _steps(f, i) for f, i in IDS if CASES[f][i].ranks and not CASES[f][i].skip}
    return _dist.run_ranks(D.on_ranks, world=2, timeout_s=180, cases=cases)


@pytest.mark.parametrize(("f", "i"), IDS, ids=[f"{f}#{i}" for f, i in IDS])
def test_doc_block(f: str, i: int, request: pytest.FixtureRequest) -> None:
    case = CASES[f][i]
    if case.skip:
        pytest.skip(f"{f} block {i}: {case.skip}")
    if case.ranks:
        for rank, errors in enumerate(request.getfixturevalue("rank_results")):
            assert errors[f"{f}#{i}"] is None, f"rank {rank}:\n{errors[f'{f}#{i}']}"
        return
    D.run(_steps(f, i), _ns())
