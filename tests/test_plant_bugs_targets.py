"""Every mutant of tests/plant_bugs.py still has its target.

plant_bugs reports a mutant whose ``old`` text is absent (or not unique) as NOT
APPLICABLE and moves on, so a refactor that moves or rewrites the code a mutant
plants its bug in silently turns that mutant into a no-op. This cheap check
(no build, no mutation run) fails instead: each mutant's file exists, its ``old``
text occurs exactly once there, the Python it leaves still compiles (a mutant
that leaves an indented line behind is "caught" by the import error, whatever
the tests check; so is one that names something undefined, which ruff's F821
finds), and every test file it runs exists.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import plant_bugs  # noqa: E402  (a script in tests/, imported as a module for its MUTANTS)

ROOT = Path(__file__).resolve().parents[1]
FIX = ("update this Mutant in tests/plant_bugs.py so that it plants the same bug where the code now "
       "lives (path, old, new), or delete it if the behaviour was removed by design")


def test_mutant_names_are_unique():
    names = [m.name for m in plant_bugs.MUTANTS]
    assert len(names) == len(set(names)), f"duplicate mutant names: {sorted({n for n in names if names.count(n) > 1})}"


@pytest.mark.parametrize("m", plant_bugs.MUTANTS, ids=lambda m: m.name)
def test_mutant_target_is_present(m):
    path = ROOT / m.path
    assert path.is_file(), f"mutant {m.name!r}: {m.path} does not exist; {FIX}"
    text = path.read_text()
    n = text.count(m.old)
    assert n == 1, (f"mutant {m.name!r}: its old text occurs {n} times in {m.path} (must be exactly once, "
                    f"or plant_bugs reports it NOT APPLICABLE); {FIX}")
    assert m.old != m.new, f"mutant {m.name!r}: old and new are the same text, it plants nothing"
    if m.path.endswith(".py"):
        try:
            compile(text.replace(m.old, m.new), m.path, "exec")
        except SyntaxError as e:
            pytest.fail(f"mutant {m.name!r}: the mutated {m.path} does not compile ({e}), so any test "
                        f"would 'catch' it; make its new text plant the bug in valid Python")
        if _ruff_module():
            undefined = subprocess.run(
                [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F821", "--output-format",
                 "concise", "--stdin-filename", m.path, "-"],
                input=text.replace(m.old, m.new), capture_output=True, text=True, timeout=60)
            assert undefined.returncode == 0, (
                f"mutant {m.name!r}: the mutated {m.path} names something undefined, so a NameError would "
                f"'catch' it whatever the tests check:\n{undefined.stdout}")
    assert m.tests, f"mutant {m.name!r} names no test files; name the tests that catch its bug"
    for t in m.tests:
        assert (ROOT / t).is_file(), (f"mutant {m.name!r}: its test file {t} does not exist; point the "
                                      "mutant at the tests that now cover its bug (grep tests/)")


def _ruff_module() -> bool:
    """Whether ``python -m ruff`` runs here (the test extra installs it)."""
    import importlib.util

    return importlib.util.find_spec("ruff") is not None
