"""Runs the Triton kernels on CPU through the Triton interpreter, inside the normal
`pytest tests` session.

TRITON_INTERPRET must be set before kvpool.kernels is imported (it is read when
@triton.jit runs), and this session may already have imported it without the
variable (the pool imports the kernels). So the cases in interp_kernels_cases.py
(the kernels) and interp_pool_cases.py (KVPool's paths through them) run once in a child pytest with the variable set, writing a JUnit report; each
test below stands for one test function there and passes only if that function
ran (at least one case) and every case passed — nothing skipped. A crash in the
child (e.g. an out-of-bounds write) fails every test with the child's output.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CASES = [HERE / "interp_kernels_cases.py", HERE / "interp_pool_cases.py"]
CHILD_TIMEOUT_S = int(os.environ.get("KVPOOL_INTERP_TIMEOUT", "1200"))


def _case_names() -> list[str]:
    trees = [ast.parse(path.read_text()) for path in CASES]
    return [n.name for tree in trees for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


@pytest.fixture(scope="session")
def interp_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("interp") / "report.xml"
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    # The child must import the same kvpool as this session.
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={out}", *map(str, CASES)]
    try:
        proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"interpreter child pytest exceeded {CHILD_TIMEOUT_S}s: {e}")
    log = (proc.stdout or "")[-6000:] + (proc.stderr or "")[-4000:]
    if not out.exists():
        pytest.fail(f"interpreter child pytest wrote no report (exit {proc.returncode}):\n{log}")
    results: dict[str, list[tuple[str, str]]] = {}
    for case in ET.parse(out).getroot().iter("testcase"):
        name = case.get("name", "").split("[")[0]
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = f"{tag}: {el.get('message', '')}\n{(el.text or '')[-3000:]}"
        results.setdefault(name, []).append((case.get("name", ""), outcome))
    print(f"\n[interpreter child] exit {proc.returncode}: {log.strip().splitlines()[-1] if log.strip() else ''}")
    return results, log


@pytest.mark.parametrize("case", _case_names())
def test_interpreter(case, interp_report):
    results, log = interp_report
    ran = results.get(case)
    assert ran, f"{case} did not run in the interpreter session:\n{log}"
    bad = [(name, outcome) for name, outcome in ran if outcome != "passed"]
    assert not bad, f"{len(bad)}/{len(ran)} cases of {case} did not pass:\n" + "\n".join(
        f"{n}: {o}" for n, o in bad
    )
