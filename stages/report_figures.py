"""The report's figures (`reports/figures/*.png`): acc_k and α_k vs k per study, step retention per drafter, τ and
speedup end to end; 95% intervals as bands or error bars. Same numbers, same PNG bytes: matplotlib's Agg backend
with no software stamp in the metadata (the report is a pure function of its inputs, DESIGN §8)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from stages.common import atomic_path
from stages.report_cells import PAPER_LABEL, paper_row, tree_text
from stages.results import LOOKUP_KIND, PAPER_TREE, E2EGroup, Setting, label
from stages.sections import ReportParams


class FigureDir:
    """The figures folder of one report: the figures drawn into it, and those of an earlier report to remove."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.written: list[str] = []

    def add(self, name: str, draw: Callable[[Path], None]) -> str:
        """Draw figure `name` (`draw` writes the PNG at the path it gets); its link relative to the README."""
        draw(self.folder / name)
        self.written.append(name)
        return f"figures/{name}"

    def remove_stale(self) -> None:
        """A figure of a study that is gone must not linger beside the new README."""
        for stale in sorted(self.folder.glob("*.png")) if self.folder.is_dir() else []:
            if stale.name not in self.written:
                stale.unlink()


def _figure(params: ReportParams, nrows: int = 1, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(nrows, ncols, figsize=(params.figure_width, params.figure_height), dpi=params.dpi)
    return plt, fig, ax


def _save(plt, fig, path: Path, params: ReportParams) -> None:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=params.dpi, metadata={"Software": None})   # same numbers, same bytes
    plt.close(fig)


def plot_steps(study: str, settings: list[Setting], paper: dict | None, path: Path, params: ReportParams) -> None:
    """acc_k (left, the paper's points hollow) and chain α_k (right) vs k, one line per setting, 95% bands."""
    plt, fig, (ax1, ax2) = _figure(params, 1, 2)
    fig.set_size_inches(params.figure_width * 1.6, params.figure_height)
    colors = plt.get_cmap("tab10").colors
    has_paper = False
    for i, s in enumerate(x for x in settings if x.n > 0):
        c = colors[i % len(colors)]
        for ax, family in ((ax1, "acc"), (ax2, "alpha")):
            ks = [k for k in range(s.steps) if math.isfinite(s.value(f"{family}_{k}"))]
            ys = [s.value(f"{family}_{k}") for k in ks]
            ax.plot(ks, ys, "-o", color=c, ms=3.5, lw=1.6, label=f"{label(s)} (n={s.n})")
            cis = [s.ci(f"{family}_{k}", params.level) for k in ks]
            if cis and all(math.isfinite(lo) for lo, _ in cis):
                ax.fill_between(ks, [lo for lo, _ in cis], [hi for _, hi in cis], color=c, alpha=0.15, lw=0)
        prow = paper_row(paper, s.fields)
        pts = [(k, prow[f"alpha_{k}"]) for k in range(7) if prow and prow.get(f"alpha_{k}") is not None]
        if pts:
            has_paper = True
            ax1.plot(*zip(*pts), "o", mfc="none", mec=c, ms=7, mew=1.4)
    if has_paper:
        ax1.plot([], [], "o", mfc="none", mec="0.3", ms=7, label=f"hollow: {PAPER_LABEL} α_k")
    for ax, title, ylabel in ((ax1, "step accuracy acc_k (paper's α_k)", "acc_k"),
                              (ax2, "chain acceptance α_k", "α_k (chain)")):
        lo, hi = ax.dataLim.y0, ax.dataLim.y1
        pad = max(0.05, 0.1 * (hi - lo)) if math.isfinite(lo) and math.isfinite(hi) else 0.5
        ax.set(xlabel="speculative step k", ylabel=ylabel, title=f"{title} — {study}",
               ylim=(max(0.0, lo - pad), min(1.0, hi + pad)) if math.isfinite(lo) else (0, 1))
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=6, loc="best", ncol=2 if len(settings) > 4 else 1, framealpha=0.85)
    _save(plt, fig, path, params)


def plot_retention(studies: dict[str, list[Setting]], papers: dict, path: Path, params: ReportParams) -> None:
    """Step retention acc_6/acc_0 per setting of every study, 95% intervals, the paper's value as a black tick."""
    plt, fig, ax = _figure(params)
    labels, vals, lows, highs, marks = [], [], [], [], []
    for study, settings in studies.items():
        for s in settings:
            v = s.value("step_retention")
            if not math.isfinite(v):
                continue
            lo, hi = s.ci("step_retention", params.level)
            labels.append(f"{study}: {label(s)}")
            vals.append(v)
            lows.append(v - lo if math.isfinite(lo) else 0.0)
            highs.append(hi - v if math.isfinite(hi) else 0.0)
            prow = paper_row(papers.get(study), s.fields)
            marks.append(prow.get("retention") if prow else None)
    y = list(range(len(labels)))[::-1]
    ax.barh(y, vals, xerr=[lows, highs], color="tab:blue", alpha=0.75, height=0.7, error_kw={"lw": 1})
    pts = [(m, yy) for m, yy in zip(marks, y) if m is not None]
    if pts:
        ax.plot(*zip(*pts), "|", color="black", ms=12, mew=2, label=PAPER_LABEL)
        ax.legend(fontsize=7, loc="lower right")
    ax.set_yticks(y, labels, fontsize=6 if len(labels) > 12 else 7)
    ax.set(xlabel="step retention acc_6 / acc_0", xlim=(0, max([1.05, *[v + h for v, h in zip(vals, highs)]])),
           title="Step retention per drafter (95% intervals)")
    ax.grid(axis="x", alpha=0.3)
    fig.set_size_inches(params.figure_width, max(params.figure_height, 0.28 * len(labels) + 1.2))
    _save(plt, fig, path, params)


def plot_e2e(groups: list[E2EGroup], path: Path, params: ReportParams) -> None:
    """τ at the paper and the tuned tree, and speedup at the tuned tree (with the lookup branch when decoded)."""
    plt, fig, (ax1, ax2) = _figure(params, 1, 2)
    names = [label(g, with_scale=True).replace(", ", "\n", 1) for g in groups]
    x = range(len(groups))

    def bars(ax, kinds, metric):
        w = 0.8 / len(kinds)
        for i, (kind, color, lab) in enumerate(kinds):
            vals, err_lo, err_hi = [], [], []
            for g in groups:
                k = g.kinds.get(kind)
                v = k.point.get(metric, math.nan) if k else math.nan
                lo, hi = k.ci(metric, params.level) if k else (math.nan, math.nan)
                vals.append(v if math.isfinite(v) else 0.0)
                err_lo.append(v - lo if math.isfinite(lo) else 0.0)
                err_hi.append(hi - v if math.isfinite(hi) else 0.0)
            ax.bar([j + (i - (len(kinds) - 1) / 2) * w for j in x], vals, w, yerr=[err_lo, err_hi], color=color,
                   label=lab, error_kw={"lw": 1})

    bars(ax1, [("paper", "tab:blue", f"tree {tree_text(list(PAPER_TREE))}"), ("tuned", "tab:orange", "tuned tree")],
         "tau")
    ax1.set(ylabel="τ (accepted + 1 per round)", title="τ")
    kinds = [("tuned", "tab:green", "drafter")]
    if any(LOOKUP_KIND in g.kinds for g in groups):
        kinds.append((LOOKUP_KIND, "tab:purple", "drafter + lookup branch"))
    bars(ax2, kinds, "speedup")
    ax2.axhline(1.0, color="0.3", lw=1, ls="--")
    ax2.set(ylabel="speedup vs greedy", title="speedup (tuned tree)")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), names, fontsize=6, rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    _save(plt, fig, path, params)


__all__ = ["FigureDir", "plot_e2e", "plot_retention", "plot_steps"]
