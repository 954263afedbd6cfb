"""The toy decode step the runner tests use (it lives in kvpool.demo.toy_step so that
benchmarks/gpu_check.py can use it from a checkout without importing tests/)."""

from kvpool.demo.toy_step import ToyDecode

__all__ = ["ToyDecode"]
