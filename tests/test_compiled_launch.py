"""kvpool.kernels.launch.CompiledLaunch against a fake Triton kernel (no GPU needed): the
first launch of a plan key goes through ``kernel[grid]``, later ones straight to the
compiled kernel's launcher with the same arguments; a new key, an installed launch hook,
a kernel without the launcher interface or the interpreter keep Triton's path; the check
mode catches a key that does not determine Triton's choice. The real launcher runs in the
GPU session (the CUDA tests there set KVPOOL_CHECK_LAUNCH=1)."""

from __future__ import annotations

import pytest

from kvpool.errors import InvariantError
from kvpool.kernels import launch as L


class Chain:  # Triton 3.5+'s HookChain: always present, usually empty
    def __init__(self, calls=()):
        self.calls = list(calls)


class Runtime:
    def __init__(self):
        self.launch_enter_hook, self.launch_exit_hook = Chain(), Chain()


class Compiled:
    def __init__(self, log, name="k0"):
        self.function, self.packed_metadata, self.name, self.log = f"fn-{name}", f"meta-{name}", name, log
        self.run = lambda *a: log.append(("launcher", a))


class FakeJit:
    """``fn[grid](*args, num_warps=w, **OPTIONS)`` logs and returns the kernel for ``pick(args)``."""

    def __init__(self, log, pick=lambda args: "k0"):
        self.device_caches = {}
        self.log, self.pick, self.kernels = log, pick, {}

    def _kernel(self, args):
        name = self.pick(args)
        return self.kernels.setdefault(name, Compiled(self.log, name))

    def __getitem__(self, grid):
        def go(*args, num_warps, **options):
            assert options == L.OPTIONS  # (the compile options every kernel here is built with)
            self.log.append(("jit", grid, args, num_warps))
            return self._kernel(args)
        return go

    def run(self, *args, grid, warmup, num_warps, **options):
        assert warmup and options == L.OPTIONS
        return self._kernel(args)


@pytest.fixture
def env(monkeypatch):
    rt = Runtime()
    monkeypatch.setattr(L, "_runtime_knobs", lambda: rt)
    monkeypatch.setattr(L, "raw_stream", lambda device: 1000 + device)
    monkeypatch.setattr(L, "_CHECK", False)
    return rt


def test_first_launch_goes_through_triton_then_the_launcher_gets_the_same_arguments(env):
    log: list = []
    cl = L.CompiledLaunch(FakeJit(log))
    args = ("k_cache", "slots", 7, 16, True)
    cl.launch("key", (3, 2), args, 4, 0)
    assert log == [("jit", (3, 2), args, 4)] and len(cl) == 1
    log.clear()
    cl.launch("key", (5, 2), args, 4, 1)
    # grid x, y, z, the device's current stream, the kernel's handle and metadata, no launch
    # metadata and no hooks (both chains are empty), then every argument in order
    assert log == [("launcher", (5, 2, 1, 1001, "fn-k0", "meta-k0", None, None, None) + args)]


def test_each_key_is_compiled_through_triton_once(env):
    log: list = []
    cl = L.CompiledLaunch(FakeJit(log))
    for key in ("a", "b", "a", "b", "c"):
        cl.launch(key, (1, 1), (key,), 1, 0)
    assert [e[0] for e in log] == ["jit", "jit", "launcher", "launcher", "jit"] and len(cl) == 3


def test_an_installed_launch_hook_keeps_tritons_path(env):
    log: list = []
    cl = L.CompiledLaunch(FakeJit(log))
    cl.launch("key", (1, 1), ("x",), 1, 0)
    env.launch_enter_hook = Chain([print])  # a profiler such as Proton
    cl.launch("key", (1, 1), ("x",), 1, 0)
    env.launch_enter_hook = None  # older Triton: no hook is None
    env.launch_exit_hook = print
    cl.launch("key", (1, 1), ("x",), 1, 0)
    env.launch_exit_hook = None
    cl.launch("key", (1, 1), ("x",), 1, 0)
    assert [e[0] for e in log] == ["jit", "jit", "jit", "launcher"]


def test_a_kernel_without_the_launcher_interface_disables_the_shortcut(env):
    log: list = []
    fake = FakeJit(log)

    class Opaque:
        pass

    fake._kernel = lambda args: Opaque()
    cl = L.CompiledLaunch(fake)
    for _ in range(3):
        cl.launch("key", (1, 1), ("x",), 1, 0)
    assert [e[0] for e in log] == ["jit"] * 3 and not cl.enabled and len(cl) == 0


def test_the_interpreter_and_the_opt_out_keep_tritons_path(env, monkeypatch):
    log: list = []

    class Interpreted(FakeJit):  # TRITON_INTERPRET=1: no device caches, nothing compiled
        def __init__(self, log):
            super().__init__(log)
            del self.device_caches

    cl = L.CompiledLaunch(Interpreted(log))
    assert not cl.enabled
    monkeypatch.setattr(L, "_ENABLED", False)
    off = L.CompiledLaunch(FakeJit(log))
    assert not off.enabled
    for c in (cl, off, cl, off):
        c.launch("key", (1, 1), ("x",), 1, 0)
    assert [e[0] for e in log] == ["jit"] * 4


def test_check_mode_raises_when_the_key_does_not_determine_tritons_kernel(env, monkeypatch):
    log: list = []
    # Triton would pick the kernel by the last argument (say an alignment class) that the
    # caller's key below leaves out.
    cl = L.CompiledLaunch(FakeJit(log, pick=lambda args: f"k{args[-1]}"))
    monkeypatch.setattr(L, "_CHECK", True)
    cl.launch("key", (1, 1), ("x", 0), 1, 0)
    cl.launch("key", (1, 1), ("x", 0), 1, 0)  # the same choice: launched
    assert [e[0] for e in log] == ["jit", "launcher"]
    with pytest.raises(InvariantError, match="does not determine Triton's specialization"):
        cl.launch("key", (1, 1), ("x", 1), 1, 0)
    assert [e[0] for e in log] == ["jit", "launcher"]  # nothing launched with the wrong kernel


def test_store_plans_give_the_launch_a_fresh_computation_gives():
    """launch_store_kv keeps each plan key's derived arguments: a launch from a kept plan
    must equal one computed from scratch, across layouts, dtypes, batch sizes on both
    sides of the prefill threshold, int32/int64 slots, strided rows, scales and MLA."""
    import torch
    from _codegen import recording

    import kvpool.kernels as K
    from kvpool.kernels import store

    def cases():
        for layout in ("token", "paged"):
            for dtype, scale in ((torch.bfloat16, None), (torch.float8_e4m3fn, torch.ones(1)),
                                 (torch.float8_e4m3fn, 0.5)):
                shape = (4096, 8, 64) if layout == "token" else (256, 16, 8, 64)
                kc, vc = (torch.zeros(shape).to(dtype) for _ in range(2))  # torch 2.4 has no CPU fill of fp8
                for n in (1, 16, 7, 2048):
                    for sd in (torch.int64, torch.int32):
                        k = torch.ones((n, 8, 64), dtype=torch.bfloat16)
                        yield kc, vc, torch.arange(n, dtype=sd), k, k.clone(), scale
        wide = torch.zeros((64, 8, 80), dtype=torch.bfloat16)[..., :72]  # heads 80 apart
        k = torch.ones((3, 8, 72), dtype=torch.bfloat16)
        yield wide, wide.clone(), torch.arange(3), k, k, None
        kv = torch.ones((8, 16, 32), dtype=torch.bfloat16)[:, ::2]  # heads 64 apart in the source
        yield torch.zeros((64, 8, 32), dtype=torch.bfloat16), None, torch.arange(8), kv, None, None

    every = list(cases())

    def launches(fresh: bool):
        with recording(store, "_store_kv_kernel") as rec:
            for kc, vc, slots, k, v, scale in every:
                if fresh:
                    store._PLANS.clear()
                K.store_kv(kc, vc, slots, k, v, scale, scale if vc is not None else None)
        return rec.calls

    fresh = launches(True)  # each launch from a plan computed for it alone
    launches(False)
    n_plans = len(store._PLANS)
    kept = launches(False)  # each launch from a plan kept from earlier launches
    assert len(store._PLANS) == n_plans and len(fresh) == len(kept) == len(every) == 50
    for a, b in zip(fresh, kept):
        assert a[0] == b[0] and a[2] == b[2]
        assert len(a[1]) == len(b[1])
        for x, y in zip(a[1], b[1]):
            assert (x is y) if isinstance(x, torch.Tensor) else (type(x) is type(y) and x == y)


def test_gather_plans_give_the_launch_a_fresh_computation_gives():
    import torch
    from _codegen import recording

    import kvpool.kernels as K
    from kvpool.kernels import gather

    every = []
    for layout in ("token", "paged"):
        for dtype, kw in ((torch.bfloat16, {}), (torch.float8_e4m3fn, {"out_dtype": torch.bfloat16,
                                                                       "k_scale": torch.ones(1),
                                                                       "v_scale": 0.5})):
            shape = (4096, 8, 64) if layout == "token" else (256, 16, 8, 64)
            kc, vc = (torch.zeros(shape).to(dtype) for _ in range(2))  # torch 2.4 has no CPU fill of fp8
            for n in (1, 16, 7):
                for sd in (torch.int64, torch.int32):
                    every.append((kc, vc, torch.arange(n, dtype=sd), kw))
                    every.append((kc, None, torch.arange(n, dtype=sd), {k: v for k, v in kw.items()
                                                                        if k != "v_scale"}))

    def launches(fresh: bool):
        with recording(gather, "_gather_kv_kernel") as rec:
            for kc, vc, slots, kw in every:
                if fresh:
                    gather._PLANS.clear()
                K.gather_kv(kc, vc, slots, **kw)
        return rec.calls

    fresh = launches(True)
    launches(False)
    kept = launches(False)
    assert len(fresh) == len(kept) == len(every)
    for a, b in zip(fresh, kept):
        assert a[0] == b[0] and a[2] == b[2] and len(a[1]) == len(b[1])
        for x, y in zip(a[1], b[1]):
            if isinstance(x, torch.Tensor):  # gather_kv allocates its outputs on each call
                assert (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(), y.dtype)
            else:
                assert type(x) is type(y) and x == y


def test_the_kept_kernels_start_over_past_max_plans(env, monkeypatch):
    monkeypatch.setattr(L, "MAX_PLANS", 3)
    log: list = []
    cl = L.CompiledLaunch(FakeJit(log))
    for key in range(7):
        cl.launch(key, (1, 1), (key,), 1, 0)
        assert len(cl) <= 3
    cl.launch(6, (1, 1), (6,), 1, 0)  # kept after the last start-over: the launcher
    assert log[-1][0] == "launcher"


def test_store_plans_start_over_past_max_plans(monkeypatch):
    import torch
    from _codegen import recording

    import kvpool.kernels as K
    from kvpool.kernels import store

    monkeypatch.setattr(L, "MAX_PLANS", 2)
    store._PLANS.clear()
    kc = torch.zeros((64, 2, 8))
    with recording(store, "_store_kv_kernel") as rec:
        for n in (1, 2, 3, 16, 1):
            K.store_kv(kc, kc.clone(), torch.arange(n), torch.ones(n, 2, 8), torch.ones(n, 2, 8))
            assert len(store._PLANS) <= 2
    first, again = rec.calls[0], rec.calls[4]  # n = 1 before and after a start-over
    assert len(rec.calls) == 5 and first[0] == again[0] and first[2] == again[2]
    assert [x for x in first[1] if not isinstance(x, torch.Tensor)] == \
        [x for x in again[1] if not isinstance(x, torch.Tensor)]


def test_a_launcher_that_refuses_the_arguments_falls_back_to_triton(env):
    """Another Triton's launcher convention (say, constexprs left out) raises TypeError
    before launching: that launch and every later one go through kernel[grid]."""
    log: list = []
    fake = FakeJit(log)
    cl = L.CompiledLaunch(fake)
    cl.launch("key", (1, 1), ("x",), 1, 0)

    def refuses(*a):
        raise TypeError("function takes 12 positional arguments but 13 were given")

    fake.kernels["k0"].run = refuses
    cl._compiled["key"] = (refuses,) + cl._compiled["key"][1:]
    cl.launch("key", (1, 1), ("x",), 1, 0)
    cl.launch("key", (1, 1), ("x",), 1, 0)
    assert [e[0] for e in log] == ["jit", "jit", "jit"] and not cl.enabled and len(cl) == 0
