"""PNG plot of churn results: µs per step against pool size and against concurrency."""

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
