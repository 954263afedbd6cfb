"""Environment of a GPU session (benchmarks/gpu_session.py): versions, the GPU and its
driver, the glibc the box has and the one the carried kvpool/_core.abi3.so needs.

Reads only; never fails on a missing tool (nvidia-smi, a package): it records why.
Writes JSON to --out and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "python" / "kvpool" / "_core.abi3.so"
NVSMI_FIELDS = ("name,driver_version,memory.total,memory.used,clocks.max.sm,clocks.max.mem,"
                "power.limit,temperature.gpu,persistence_mode,compute_mode,mig.mode.current")


def _version_key(v: str) -> list[int]:
    return [int(x) for x in v.split(".") if x.isdigit()]


def glibc_needed(so: Path) -> str | None:
    """Highest GLIBC_x.y version the shared object asks for (the names of its version
    requirements are plain strings in the file, so no binutils are needed)."""
    if not so.exists():
        return None
    found = set(re.findall(rb"GLIBC_(\d+\.\d+(?:\.\d+)?)", so.read_bytes()))
    versions = sorted((v.decode() for v in found), key=_version_key)
    return versions[-1] if versions else None


def _run(cmd: list[str], timeout: float = 20.0) -> dict[str, Any]:
    if shutil.which(cmd[0]) is None:
        return {"error": f"{cmd[0]} not found"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout}s"}
    return {"rc": p.returncode, "stdout": p.stdout[-20000:], "stderr": p.stderr[-2000:]}


def _module_version(name: str) -> str:
    try:
        mod = __import__(name)
    except Exception as e:  # noqa: BLE001 - record whatever breaks the import
        return f"unavailable ({type(e).__name__}: {e})"
    return str(getattr(mod, "__version__", "?"))


def capture(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "glibc": "-".join(platform.libc_ver()),
        "glibc_confstr": os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None,
        "core_so": str(CORE) if CORE.exists() else "missing",
        "core_so_needs_glibc": glibc_needed(CORE),
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "TRITON_CACHE_DIR", "PYTHONPATH")},
    }
    for name in ("numpy", "torch", "triton", "pytest", "hypothesis"):
        env[name] = _module_version(name)
    try:
        import kvpool._core as core

        env["core_import"] = f"ok ({core.__file__})"
    except Exception as e:  # noqa: BLE001
        env["core_import"] = f"failed: {type(e).__name__}: {e}"
    try:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            env["gpus"] = []
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                env["gpus"].append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                                    "memory_GiB": round(p.total_memory / 2**30, 1),
                                    "sms": p.multi_processor_count})
            env["cudnn"] = torch.backends.cudnn.version()
            free, total = torch.cuda.mem_get_info()
            env["mem_free_GiB"] = round(free / 2**30, 1)
    except Exception as e:  # noqa: BLE001
        env["torch_error"] = f"{type(e).__name__}: {e}"
    smi = _run(["nvidia-smi", f"--query-gpu={NVSMI_FIELDS}", "--format=csv"])
    env["nvidia_smi"] = smi.get("stdout", smi.get("error", "")).strip()
    if device == "cuda":
        env["nvidia_smi_q"] = _run(["nvidia-smi", "-q"]).get("stdout", "")
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    env = capture(args.device)
    Path(args.out).write_text(json.dumps(env, indent=2, default=str))
    short = {k: v for k, v in env.items() if k != "nvidia_smi_q"}
    print(json.dumps(short, indent=2, default=str))
    needs, have = env["core_so_needs_glibc"], (env["glibc_confstr"] or "").split()[-1:]
    if needs and have and _version_key(have[0]) < _version_key(needs):
        print(f"WARNING: _core.abi3.so needs glibc {needs}, this box has {have[0]}: build it on an older glibc")
    return 0


if __name__ == "__main__":
    sys.exit(main())
