"""Case builders shared by kvpool's tests and ``benchmarks/gpu_check.py``.

``kernel_cases``: caches, slots and rows for the kernel tests, with values that
convert exactly in every dtype (so bitwise comparisons are meaningful).
``toy_step``: a tiny capturable decode step that writes and reads through a pool.
Not imported by ``kvpool`` itself.
"""
