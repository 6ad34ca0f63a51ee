"""The figures of a bench report, as PNG files.

Drawn with matplotlib's object API (`Figure`, saved through the Agg canvas): no pyplot, no global
state, no display needed. Every function takes plain data, not results.json, and returns the path
it wrote, or None when there is nothing to draw (no method drafts, say). Methods are rows, so long
labels stay readable with 10+ methods; workloads keep one colour in every figure.

    values[m][w]   the figure of method m on workload w, None when missing
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from matplotlib.figure import Figure

DPI = 110
WORKLOAD_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">"]
LINESTYLES = ["-", "--", "-.", ":"]


def _colour(j: int) -> str:
    return WORKLOAD_COLOURS[j % len(WORKLOAD_COLOURS)]


def _wrap(label: str, width: int = 34) -> str:
    return "\n".join(textwrap.wrap(label, width)) or label


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    return path


def bars_by_method(path: Path, title: str, xlabel: str, labels: list[str], workloads: list[str],
                   values: list[list[float | None]], reference: float | None = 1.0,
                   reference_label: str = "", pattern: str = "{:.2f}", note: str = "") -> Path | None:
    """Horizontal bars grouped by method (one bar per workload), the value written at each bar's end,
    and a dashed line at `reference`. A missing figure is written as "-" at the axis."""
    if not labels or not workloads or all(v is None for row in values for v in row):
        return None
    k = len(workloads)
    bar = 0.8 / k
    fig = Figure(figsize=(10, 1.5 + len(labels) * (0.2 * k + 0.25)), layout="constrained")
    ax = fig.add_subplot()
    top = max((v for row in values for v in row if v is not None), default=1.0)
    top = max(top, reference or 0.0)
    for j, w in enumerate(workloads):
        ys = [i + (j - (k - 1) / 2) * bar for i in range(len(labels))]
        xs = [row[j] if row[j] is not None else 0.0 for row in values]
        ax.barh(ys, xs, height=bar * 0.92, color=_colour(j), label=w)
        for y, row in zip(ys, values):
            v = row[j]
            text = "-" if v is None else pattern.format(v)
            ax.text((v or 0.0) + top * 0.01, y, text, va="center", fontsize=7,
                    color="#555555" if v is None else "#222222")
    if reference is not None:
        ax.axvline(reference, color="#333333", linestyle="--", linewidth=1, zorder=0)
        if reference_label:
            ax.text(reference, -0.6, f" {reference_label}", fontsize=8, color="#333333", va="bottom")
    ax.set_yticks(range(len(labels)), [_wrap(label) for label in labels], fontsize=9)
    ax.set_ylim(len(labels) - 0.5, -0.5 - (0.5 if reference_label else 0.0))  # first method on top
    ax.set_xlim(0, top * 1.15)
    ax.set_xlabel(xlabel)
    ax.xaxis.grid(True, color="#DDDDDD")
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=11, loc="left")
    ax.legend(title="workload", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _save(fig, path)


def _grid(n: int, ncols: int) -> tuple[int, int]:
    ncols = max(1, min(ncols, n))
    return math.ceil(n / ncols), ncols


def acceptance_lines(path: Path, labels: list[str], workloads: list[str],
                     curves: list[list[list[float] | None]]) -> Path | None:
    """Acceptance rate by draft position: one panel per workload, one line per method."""
    drawn = [i for i, row in enumerate(curves) if any(c for c in row)]
    if not drawn:
        return None
    nrows, ncols = _grid(len(workloads), 2)
    fig = Figure(figsize=(5.2 * ncols + 3.2, 3.8 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharey=True, squeeze=False).ravel()
    depth = max(len(c) for row in curves for c in row if c)
    colours = dict(zip(drawn, _method_colours(len(drawn))))
    for j, w in enumerate(workloads):
        ax = axes[j]
        for i in drawn:
            c = curves[i][j]
            if c:
                n = drawn.index(i)
                ax.plot(range(1, len(c) + 1), c, color=colours[i], marker=MARKERS[n % len(MARKERS)],
                        linestyle=LINESTYLES[(n // len(MARKERS)) % len(LINESTYLES)], markersize=4,
                        linewidth=1.4, label=_wrap(labels[i], 40))
        ax.set_title(w, fontsize=10)
        ax.set_xlabel("draft position (depth)")
        ax.set_xticks(range(1, depth + 1) if depth <= 12 else range(1, depth + 1, max(1, depth // 10)))
        ax.set_xlim(0.7, depth + 0.3)
        ax.set_ylim(0, 1.04)
        ax.grid(True, color="#E5E5E5")
        if j % ncols == 0:
            ax.set_ylabel("accepted share of drafted")
    for ax in axes[len(workloads):]:
        ax.set_visible(False)
    handles, names = _unique_legend(axes[:len(workloads)])
    fig.legend(handles, names, title="method", loc="outside right upper", fontsize=8, frameon=False)
    fig.suptitle("Acceptance by draft position (of rounds that drafted depth d, the share accepting it)",
                 fontsize=11, x=0.0, ha="left")
    return _save(fig, path)


def length_histograms(path: Path, labels: list[str], workloads: list[str],
                      hists: list[list[list[int] | None]]) -> Path | None:
    """Accepted drafts per round: one small panel per method, bars per workload, as shares of rounds."""
    drawn = [i for i, row in enumerate(hists) if any(h and sum(h) for h in row)]
    if not drawn:
        return None
    nrows, ncols = _grid(len(drawn), 4)
    fig = Figure(figsize=(max(3.4 * ncols + 1.6, 8.0), 2.5 * nrows + 1.2), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False).ravel()
    longest = max(len(h) for row in hists for h in row if h)
    k = len(workloads)
    width = 0.8 / k
    for panel, i in enumerate(drawn):
        ax = axes[panel]
        for j, w in enumerate(workloads):
            h = hists[i][j]
            if not h or not sum(h):
                continue
            total = sum(h)
            ax.bar([a + (j - (k - 1) / 2) * width for a in range(len(h))], [n / total for n in h],
                   width=width, color=_colour(j), label=w)
        ax.set_title(_wrap(labels[i], 30), fontsize=9)
        ax.set_xticks(range(longest) if longest <= 12 else range(0, longest, max(1, longest // 8)))
        ax.yaxis.grid(True, color="#E5E5E5")
        ax.set_axisbelow(True)
        if panel % ncols == 0:
            ax.set_ylabel("share of rounds")
        if panel >= len(drawn) - ncols:  # nothing below it: its own x axis is the one to read
            ax.set_xlabel("drafts accepted in a round")
            ax.xaxis.set_tick_params(labelbottom=True)
    for ax in axes[len(drawn):]:
        ax.set_visible(False)
    handles, names = _unique_legend(axes[:len(drawn)])
    fig.legend(handles, names, title="workload", loc="outside right upper", fontsize=8, frameon=False)
    fig.suptitle("Accepted-length histogram\n(share of rounds that accepted exactly a drafts, so committed a + 1)",
                 fontsize=11, x=0.0, ha="left")
    return _save(fig, path)


def _method_colours(n: int) -> list:
    """Distinct colours for up to 20 methods (tab20 pairs split apart), then they repeat; markers
    and line styles tell repeats apart."""
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    order = list(range(0, 20, 2)) + list(range(1, 20, 2))
    return [cmap(order[i % 20]) for i in range(n)]


def _unique_legend(axes) -> tuple[list, list[str]]:
    handles, names = [], []
    for ax in axes:
        for h, name in zip(*ax.get_legend_handles_labels()):
            if name not in names:
                handles.append(h)
                names.append(name)
    return handles, names
