"""PNG plots: churn (µs per step against pool size and concurrency) and prefix (µs per step and hit share)."""

from __future__ import annotations

import os
from typing import Any

from kvpool.bench.report import size
from kvpool.bench.runner import ChurnResult

_STYLE: dict[str, dict[str, Any]] = {
    "kvpool": dict(color="#d62728", marker="o", linewidth=2.2),
    "sglang-token": dict(color="#1f77b4", marker="s"),
    "sglang-paged": dict(color="#17becf", marker="D"),
    "vllm-blockpool": dict(color="#2ca02c", marker="^"),
    "sglang": dict(color="#1f77b4", marker="s"),
    "sglang-unified": dict(color="#9467bd", marker="P"),
    "vllm": dict(color="#2ca02c", marker="^"),
}


def churn_plot(results: list[ChurnResult], path: str, *, ref_pool: int, ref_concurrency: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    pages = sorted({r.page_size for r in results})
    fig, axes = plt.subplots(len(pages), 2, figsize=(9, 3.2 * len(pages)), squeeze=False, dpi=80)
    for row, ps in enumerate(pages):
        here = [r for r in results if r.page_size == ps]
        names = list(dict.fromkeys(r.allocator for r in here))
        panels = (
            (axes[row][0], "num_slots", lambda r: r.concurrency == ref_concurrency,
             f"pool size (slots), concurrency {ref_concurrency}"),
            (axes[row][1], "concurrency", lambda r: r.num_slots == ref_pool,
             f"concurrency, pool {size(ref_pool)} slots"),
        )
        for ax, xattr, keep, xlabel in panels:
            for name in names:
                pts = sorted((getattr(r, xattr), r.mean_us) for r in here if r.allocator == name and keep(r))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **_STYLE.get(name, {}))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("µs per step (mean)")
            ax.set_title(f"page size {ps}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            xs = sorted({getattr(r, xattr) for r in here if keep(r)})
            ax.set_xticks(xs, [size(x) if xattr == "num_slots" else str(x) for x in xs])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # keep only the run's sizes
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.legend(fontsize=8)
    fig.suptitle("Host time per continuous-batching step: allocator + table update", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def prefix_plot(results: list, path: str) -> None:
    """Per page size: µs per step (log) and prefix-hit share, one group of bars per scenario and pool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pages = sorted({r.page_size for r in results})
    fig, axes = plt.subplots(len(pages), 2, figsize=(11, 3.4 * len(pages)), squeeze=False, dpi=80)
    for row, ps in enumerate(pages):
        here = [r for r in results if r.page_size == ps]
        groups = list(dict.fromkeys((r.scenario, r.num_slots) for r in here))
        names = list(dict.fromkeys(r.allocator for r in here))
        width = 0.8 / max(1, len(names))
        for ax, attr, ylabel, log in ((axes[row][0], "mean_us", "µs per step (mean)", True),
                                      (axes[row][1], "hit_share", "prefix-hit share of prompt tokens", False)):
            for j, name in enumerate(names):
                xs, ys = [], []
                for i, g in enumerate(groups):
                    for r in here:
                        if r.allocator == name and (r.scenario, r.num_slots) == g:
                            xs.append(i + (j - (len(names) - 1) / 2) * width)
                            ys.append(getattr(r, attr))
                style = _STYLE.get(name, {})
                ax.bar(xs, ys, width, label=name, color=style.get("color"))
            ax.set_xticks(range(len(groups)), [f"{sc}\n{size(pool)}" for sc, pool in groups], fontsize=8)
            if log:
                ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            ax.set_title(f"page size {ps}", fontsize=10)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("Prefix caching: host time per step and hit share, kvpool vs SGLang and vLLM", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
