#!/usr/bin/env bash
# Build kvpool._core in release mode (abi3: one .so for every CPython >= 3.9) and
# put it at python/kvpool/_core.abi3.so, so the checkout runs without `pip install`
# — e.g. on a GPU box with no network, Rust or maturin:
#   bash benchmarks/build_core.sh                      # here (needs Rust + maturin)
#   PYTHONPATH=python python benchmarks/gpu_check.py   # there, from the checkout root
# Carry python/kvpool/_core.abi3.so along (*.so is git-ignored). The .so links only
# libc and libgcc_s; the glibc it needs is printed below (the box's must be >= it).
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/core-wheel
rm -rf "$out"
maturin build --release --out "$out"
python3 - "$out" <<'PY'
import pathlib, sys, zipfile

whl = next(pathlib.Path(sys.argv[1]).glob("kvpool-*.whl"))
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.startswith("kvpool/_core") and n.endswith(".so"))
    data = z.read(name)
dst = pathlib.Path("python/kvpool/_core.abi3.so")
dst.write_bytes(data)
dst.chmod(0o755)
print(f"{dst}: {len(data) >> 10} KiB from {whl.name} ({name})")
PY
if command -v objdump >/dev/null; then
  echo "needs glibc >= $(objdump -T python/kvpool/_core.abi3.so | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1)"
fi
