"""The cheap-to-check claims README.md and docs/*.md make around their examples: the
docs/errors.md's error table (each class, its base, and the failure it names raises it), the
files and links they point to, and the flags of the commands they show.
(tests/test_doc_examples.py runs the ```python blocks themselves.)"""

from __future__ import annotations

import glob
import re
import sys
from pathlib import Path

import pytest
import torch

import kvpool
import kvpool.errors
import kvpool.kernels

sys.path.insert(0, str(Path(__file__).parent))
from _doc_blocks import DOCS, ROOT  # noqa: E402

ERRORS = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")


def _error_table() -> dict[str, str]:
    """docs/errors.md's table: exception name -> its row's first cell (with the base it states)."""
    section = ERRORS
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for name in re.findall(r"`(\w+Error)`", first):
            if name not in ("ValueError", "RuntimeError", "TypeError"):  # the bases a row states
                rows[name] = first
    return rows


TABLE = _error_table()


def test_readme_error_table_names_real_classes_with_the_bases_it_states():
    # Every error class kvpool exports has a row, so an engine author finds each one there.
    exported = {n for n in kvpool.errors.__all__ if isinstance(getattr(kvpool.errors, n), type)}
    assert set(TABLE) == exported, sorted(set(TABLE) ^ exported)
    for name, cell in TABLE.items():
        cls = getattr(kvpool, name)
        assert issubclass(cls, kvpool.KVPoolError), name
        if "also a `ValueError`" in cell:
            assert issubclass(cls, ValueError), name
        if "a `RuntimeError`" in cell:
            assert issubclass(cls, RuntimeError), name
        if "a `TypeError`" in cell:
            assert issubclass(cls, TypeError), name
        if "all `InvalidArgumentError`" in cell or "both `InvalidArgumentError`" in cell:
            assert issubclass(cls, kvpool.InvalidArgumentError), name


def _pool() -> kvpool.KVPool:
    return kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=16, num_pages=8, max_requests=4, max_context_len=64)


def _raises(name: str, fn) -> str:
    """``fn()`` raises exactly the error table's class ``name``; its message."""
    assert name in TABLE
    with pytest.raises(getattr(kvpool, name)) as e:
        fn()
    assert type(e.value).__name__ == name, f"{name} expected, got {type(e.value).__name__}: {e.value}"
    return str(e.value)


def test_each_failure_the_readme_names_raises_its_class():
    pool = _pool()
    h = pool.open(2)
    pool.extend(h, [20, 3])
    k = torch.zeros(1, 2, 8)
    # "not enough free pages; the message says needed vs free pages and slots"
    msg = _raises("PoolExhaustedError", lambda: pool.admit([60, 60]))
    assert re.search(r"needs 8 free pages .* only 4 are free \(64 free slots", msg), msg
    _raises("TooManyRequestsError", lambda: pool.open(3))                 # open beyond max_requests
    _raises("ContextTooLongError", lambda: pool.extend(h[:1], 45))         # past max_context_len
    _raises("InvalidArgumentError", lambda: pool.extend(h, -1))            # negative count
    _raises("InvalidArgumentError", lambda: pool.extend(h, [1, 2, 3]))     # length mismatch
    _raises("InvalidArgumentError", lambda: pool.extend([h[0], h[0]], 1))  # duplicate handle
    _raises("InvalidArgumentError", lambda: kvpool.KVPool(2, 2, 8, page_size=0, num_pages=8))
    _raises("TensorShapeError", lambda: pool.write(0, torch.tensor([16]), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)))
    _raises("TensorDtypeError", lambda: pool.write(0, torch.tensor([16]), k.half(), k.half()))
    _raises("SlotRangeError", lambda: pool.write(0, torch.tensor([8 * 16]), k, k))      # a slot >= num_slots
    _raises("ReservedSlotError", lambda: pool.write(0, torch.tensor([3]), k, k, strict=True))
    _raises("LayerIndexError", lambda: pool.write(2, torch.tensor([16]), k, k))
    _raises("DuplicateSlotError", lambda: pool.write(0, torch.tensor([16, 16]), k.repeat(2, 1, 1), k.repeat(2, 1, 1), strict=True))
    caches = [pool.k_buffer(0), pool.v_buffer(0)]
    _raises("DuplicateSlotError", lambda: kvpool.kernels.copy_slots(caches, torch.tensor([16, 17]), torch.tensor([17, 18])))
    pool.close(h[1:])
    _raises("InvalidHandleError", lambda: pool.extend(h[1:], 1))           # closed, so stale
    assert pool.lengths(h[:1]).tolist() == [20] and pool.open_requests == 1
    pool.check()


def test_swapped_out_requests_and_closed_publishers_raise_the_readmes_classes():
    from kvpool.events import LocalEventPublisher

    pool = kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=16, num_pages=8, max_requests=4, max_context_len=64,
                         host_pages=4)
    h = pool.open(1)
    pool.extend(h, 20)
    pool.swap_out(h)
    _raises("RequestSwappedOutError", lambda: pool.extend(h, 1))
    assert pool.is_open(int(h[0])) and pool.lengths(h).tolist() == [20]  # the handle stays valid
    pub = LocalEventPublisher(pool)
    pub.close()
    _raises("PublisherClosedError", pub.publish)


def _doc_texts() -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8")) for p in DOCS]


# Paths the docs name that a build makes: the compiled core the docs tell engine authors to carry.
BUILT = ("_core.abi3.so",)


def test_links_and_repository_paths_in_the_docs_exist():
    missing = []
    for path, text in _doc_texts():
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if not target.startswith(("http://", "https://")) and not (path.parent / target).exists():
                missing.append(f"{path.name}: link {target}")
        for span in re.findall(r"`([^`\n]+)`", text):
            for ref in re.findall(r"(?<![\w/.-])((?:tests|benchmarks|python|rust|docs|fuzz)/[\w./*-]*)", span):
                ref = ref.rstrip(".")
                if ref.endswith(BUILT):  # made by the build (gitignored), absent from a fresh clone
                    continue
                if not glob.glob(str(ROOT / (ref + "*" if ref.endswith("_") else ref))):
                    missing.append(f"{path.name}: path {ref}")
    assert not missing, missing


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from kvpool.bench.__main__ import main as bench_main
    from kvpool.demo.cli import build_parser

    if argv[0] == "demo":
        return build_parser().format_help()
    with pytest.raises(SystemExit):
        bench_main([*argv, "--help"])
    return capsys.readouterr().out


def test_the_commands_the_docs_show_take_their_flags(capsys):
    seen = 0
    for path, text in _doc_texts():
        joined = re.sub(r"\\\n\s*", " ", text)   # a command continued over lines
        for m in re.finditer(r"python -m (kvpool(?:\.bench)?) ([a-z-]+)([^`\n]*)", joined):
            module, command, rest = m.groups()
            if module == "kvpool" and command != "demo":
                continue
            usage = _help([command], capsys)
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                assert flag in usage, f"{path.name}: `{m.group(0).strip()}`: {module} {command} has no {flag}"
                seen += 1
    assert seen > 20


def test_no_table_cell_is_split_by_a_pipe_inside_code():
    """GitHub splits a table row at every unescaped ``|``, code spans included: write ``\\|`` there."""
    split = []
    for path, text in _doc_texts():
        for n, line in enumerate(text.splitlines(), 1):
            if line.startswith("|"):
                split += [f"{path.name}:{n}: {span}" for span in re.findall(r"`[^`]*`", line)
                          if re.search(r"(?<!\\)\|", span)]
    assert not split, split


def test_rust_tests_the_docs_name_exist():
    """A `--skip NAME` or a named core test in the docs is a Rust `fn` that exists: a renamed
    test would leave the command skipping nothing, or the reader looking for nothing."""
    fns = {m for path in (ROOT / "rust").rglob("*.rs") for m in re.findall(r"\bfn (\w+)\s*\(", path.read_text())}
    missing = []
    for path, text in _doc_texts():
        names = re.findall(r"--skip (\w+)", text)
        names += re.findall(r"test\s+`(\w+)`\s+in\s+`rust/", text)
        missing += [f"{path.name}: {n}" for n in names if n not in fns]
    assert not missing, missing
