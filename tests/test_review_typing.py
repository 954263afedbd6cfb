"""What an engine author's ``mypy --strict`` sees of kvpool's public API.

tests/typing_engine_sample.py (not collected: no test_ prefix) calls the API the way
README.md and docs/*.md do and pins the types of the results with ``assert_type``;
mypy --strict must report nothing in it. Each pinned type was ``Any`` once (a stub's
``-> Any``, a name loaded through a module ``__getattr__``, a ``property`` built at
runtime), which --strict then reported in the user's code as ``no-any-return`` and which
hid real mistakes. The ``reveal_type`` lines list more results that must not be Any.

The mypy cache is kept in the temp directory between runs: a cold run analyses torch
(about 20 s of CPU), a warm one takes seconds.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api")
pytest.importorskip("torch")

SAMPLE = Path(__file__).resolve().parent / "typing_engine_sample.py"


# transformers is not analysed (half of a cold run): its classes are Any to this check,
# kvpool's own (KVPoolCache and the rest) are not.
CONFIG = "[mypy]\n[mypy-transformers.*]\nfollow_imports = skip\n"


def run_mypy(path: Path, scratch: Path) -> tuple[str, int]:
    cache = Path(tempfile.gettempdir()) / "kvpool-typing-mypy-cache"
    config = scratch / "mypy.ini"
    config.write_text(CONFIG)
    stdout, stderr, status = api.run([
        "--strict", "--follow-imports=silent", "--no-error-summary", "--show-error-codes",
        f"--cache-dir={cache}", f"--config-file={config}", str(path),
    ])
    return stdout + stderr, status


@pytest.fixture(scope="module")
def sample_report(tmp_path_factory) -> str:
    # mypy finds kvpool on the interpreter's path, as the tests import it (PYTHONPATH or an install).
    out, status = run_mypy(SAMPLE, tmp_path_factory.mktemp("mypy"))
    assert status in (0, 1), out
    return out


def test_the_engine_sample_type_checks_strictly(sample_report):
    errors = [line for line in sample_report.splitlines() if ": error:" in line]
    assert errors == [], "\n".join(errors)


def test_revealed_types_are_not_any(sample_report):
    revealed = re.findall(r":(\d+): note: Revealed type is \"(.*)\"", sample_report)
    wanted = SAMPLE.read_text().count("reveal_type(")
    assert len(revealed) == wanted >= 5, sample_report
    lines = SAMPLE.read_text().splitlines()
    anys = [f"{lines[int(n) - 1].strip()}: {t}" for n, t in revealed if t == "Any" or t.startswith("Any ")]
    assert anys == [], "\n".join(anys)


def test_the_check_catches_an_any(tmp_path):
    """Guards the guard: a result typed Any fails assert_type under mypy."""
    bad = tmp_path / "bad_sample.py"
    bad.write_text("from typing import Any\nfrom typing_extensions import assert_type\n\n"
                   "def f(x: Any) -> None:\n    assert_type(x.free_pages, int)\n")
    out, status = run_mypy(bad, tmp_path)
    assert status == 1 and 'Expression is of type "Any", not "int"  [assert-type]' in out, out
