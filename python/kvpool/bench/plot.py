"""One PNG maker for every workload: a row of panels per page size, one series per allocator.

A workload declares its panels: ``Lines`` (mean µs per step against a pool
dimension, log-log) or ``Bars`` (a figure of each case side by side).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Hashable
from typing import Any

from kvpool.bench.columns import size

_STYLE: dict[str, dict[str, Any]] = {
    "kvpool": dict(color="#d62728", marker="o", linewidth=2.2),
    "sglang-token": dict(color="#1f77b4", marker="s"),
    "sglang-paged": dict(color="#17becf", marker="D"),
    "vllm-blockpool": dict(color="#2ca02c", marker="^"),
    "sglang": dict(color="#1f77b4", marker="s"),
    "sglang-unified": dict(color="#9467bd", marker="P"),
    "vllm": dict(color="#2ca02c", marker="^"),
}


@dataclasses.dataclass(frozen=True)
class Lines:
    """Mean µs per step against ``x`` (a result field), over the rows ``keep`` accepts."""

    x: str
    keep: Callable[[Any], bool]
    xlabel: str

    def draw(self, ax: Any, rows: list[Any], names: list[str]) -> None:
        import matplotlib.ticker

        for name in names:
            pts = sorted((getattr(r, self.x), r.mean_us) for r in rows if r.allocator == name and self.keep(r))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **_STYLE.get(name, {}))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(self.xlabel)
        ax.set_ylabel("µs per step (mean)")
        ax.grid(True, which="both", alpha=0.3)
        xs = sorted({getattr(r, self.x) for r in rows if self.keep(r)})
        ax.set_xticks(xs, [size(x) if self.x == "num_slots" else str(x) for x in xs])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # keep only the run's sizes
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


@dataclasses.dataclass(frozen=True)
class Bars:
    """``y`` (a result field) for each group of rows, one bar per allocator."""

    y: str
    ylabel: str
    log: bool
    group: Callable[[Any], Hashable]  # which bar group a row belongs to
    group_label: Callable[[Any], str]

    def draw(self, ax: Any, rows: list[Any], names: list[str]) -> None:
        groups = list(dict.fromkeys(self.group(r) for r in rows))
        width = 0.8 / max(1, len(names))
        for j, name in enumerate(names):
            xs, ys = [], []
            for i, g in enumerate(groups):
                for r in rows:
                    if r.allocator == name and self.group(r) == g:
                        xs.append(i + (j - (len(names) - 1) / 2) * width)
                        ys.append(getattr(r, self.y))
            ax.bar(xs, ys, width, label=name, color=_STYLE.get(name, {}).get("color"))
        ax.set_xticks(range(len(groups)), [self.group_label(g) for g in groups], fontsize=8)
        if self.log:
            ax.set_yscale("log")
        ax.set_ylabel(self.ylabel)
        ax.grid(True, axis="y", alpha=0.3)


Panel = Lines | Bars


def figure(results: list[Any], path: str, panels: list[Panel], title: str,
           inches: tuple[float, float]) -> None:
    """Write a PNG: a row per page size, a column per panel. ``inches``: width, height per row."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    pages = sorted({r.page_size for r in results})
    fig, axes = plt.subplots(len(pages), len(panels), figsize=(inches[0], inches[1] * len(pages)),
                             squeeze=False, dpi=80)
    for row, ps in enumerate(pages):
        here = [r for r in results if r.page_size == ps]
        names = list(dict.fromkeys(r.allocator for r in here))
        for ax, panel in zip(axes[row], panels):
            panel.draw(ax, here, names)
            ax.set_title(f"page size {ps}", fontsize=10)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


__all__ = ["Bars", "Lines", "Panel", "figure"]
