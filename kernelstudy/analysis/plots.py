"""Figures from the analysis tables: each function takes a long-format frame and
returns a matplotlib Figure drawn with seaborn (the caller saves or closes it)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

#: Axis labels of the metrics the analyses and studies write (their names end in the unit;
#: ``_mb`` columns hold MiB, 2**20 bytes).
METRIC_LABELS = {
    "time_ms": "time (ms)",
    "peak_memory_mb": "peak memory (MiB)",
    "state_mb": "state (MiB)",
    "tokens_per_s": "tokens per second",
}


def metric_label(metric: str) -> str:
    """The axis label of ``metric`` (the name itself when it has none)."""
    return METRIC_LABELS.get(metric, metric)


def _check_columns(frame: pd.DataFrame, columns: Sequence[str | None], what: str) -> None:
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"frame must be a pandas DataFrame, got {type(frame).__name__}")
    missing = [c for c in columns if c is not None and c not in frame.columns]
    if missing:
        raise ValueError(f"{what}: frame lacks columns {missing} (has {list(frame.columns)})")
    if frame.empty:
        raise ValueError(f"{what}: frame is empty")


def _metric_rows(frame: pd.DataFrame, metric: str, what: str) -> pd.DataFrame:
    """The rows of ``metric`` with a finite ``value``; ValueError naming it when none."""
    rows = frame[frame["metric"] == metric]
    rows = rows[np.isfinite(pd.to_numeric(rows["value"], errors="coerce"))]
    if rows.empty:
        raise ValueError(
            f"{what}: metric {metric!r} has no finite values "
            f"(metrics: {sorted(map(str, frame['metric'].unique()))})"
        )
    return rows


def line_plot(
    frame: pd.DataFrame,
    x: str,
    y: str = "value",
    hue: str | None = None,
    style: str | None = None,
    col: str | None = None,
    row: str | None = None,
    logx: bool = True,
    logy: bool = True,
    errorbar: str | tuple | None = ("sd", 1),
    title: str | None = None,
    ylabel: str | None = None,
    hlines: pd.DataFrame | None = None,
    hline_label: str = "uniform baseline",
) -> Figure:
    """Mean of ``y`` vs ``x`` (error bars over the remaining rows, e.g. seeds), faceted.

    ``hlines``: rows with ``y`` (and the ``col``/``row`` facet columns) drawn as dashed
    horizontal reference lines in the matching facet, e.g. a baseline.
    """
    _check_columns(frame, [x, y, hue, style, col, row], "line_plot")
    data = frame.reset_index(drop=True)  # seaborn needs unique labels (pd.concat repeats them)
    for name in (hue, style, col, row):
        if name is not None:
            data[name] = data[name].astype(str)
    grid = sns.relplot(
        data=data,
        x=x,
        y=y,
        hue=hue,
        style=style,
        col=col,
        row=row,
        kind="line",
        marker="o",
        errorbar=errorbar,
        err_style="bars",
        height=3.6,
        aspect=1.25,
        facet_kws={"sharey": False, "sharex": False},
    )
    for (row_val, col_val), ax in _facets(grid, row, col):
        if hlines is not None and not hlines.empty:
            sel = hlines
            if col is not None and col in hlines:
                sel = sel[sel[col].astype(str) == col_val]
            if row is not None and row in hlines:
                sel = sel[sel[row].astype(str) == row_val]
            if not sel.empty:
                _baseline(ax, sel[y].mean(), hline_label)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.grid(True, which="major", alpha=0.3)
        if ylabel:
            ax.set_ylabel(ylabel)
    if title:
        grid.figure.suptitle(title, y=1.02)
    return grid.figure


def _baseline(ax, value: float, label: str) -> None:
    """A dashed horizontal reference line, labelled at its right end."""
    ax.axhline(value, color="0.3", ls="--", lw=1.2)
    ax.annotate(
        label,
        xy=(0.99, value),
        xycoords=("axes fraction", "data"),
        ha="right",
        va="bottom",
        fontsize="small",
        color="0.3",
    )


def _facets(grid: sns.FacetGrid, row: str | None, col: str | None):
    row_names = grid.row_names or [None]
    col_names = grid.col_names or [None]
    for i, row_val in enumerate(row_names):
        for j, col_val in enumerate(col_names):
            yield (row_val, col_val), grid.axes[i, j]


def plot_approximation(
    frame: pd.DataFrame,
    metric: str = "attention_mse",
    x: str = "feature_dim",
    hue: str | None = "method",
    style: str | None = None,
    col: str | None = None,
    row: str | None = None,
) -> Figure:
    """Error ``metric`` vs ``x`` from :func:`approximation_error` rows (plus config columns),
    faceted by ``col`` and ``row``.

    Rows with ``method == "uniform"`` become a dashed baseline per facet.
    """
    _check_columns(frame, ["method", "metric", "value", x], "plot_approximation")
    rows = _metric_rows(frame, metric, "plot_approximation")
    maps, base = rows[rows["method"] != "uniform"], rows[rows["method"] == "uniform"]
    return line_plot(
        maps, x, hue=hue, style=style, col=col, row=row, hlines=base, ylabel=metric, title=None
    )


def plot_map_comparison(
    frame: pd.DataFrame,
    metric: str = "attention_kl",
    x: str = "method",
    hue: str | None = "stage",
    col: str | None = None,
    logy: bool = True,
) -> Figure:
    """Bars of ``metric`` per map (mean, error bars over seeds); ``uniform`` as a dashed line."""
    _check_columns(frame, ["method", "metric", "value", x, hue, col], "plot_map_comparison")
    rows = _metric_rows(frame, metric, "plot_map_comparison")
    maps, base = rows[rows["method"] != "uniform"], rows[rows["method"] == "uniform"]
    data = maps.reset_index(drop=True)  # unique labels for seaborn
    for name in (hue, col):
        if name is not None:
            data[name] = data[name].astype(str)
    grid = sns.catplot(
        data=data,
        x=x,
        y="value",
        hue=hue,
        col=col,
        kind="bar",
        errorbar=("sd", 1),
        height=3.8,
        aspect=1.6,
        sharey=False,
    )
    for (_, col_val), ax in _facets(grid, None, col):
        sel = base if col is None or col not in base else base[base[col].astype(str) == col_val]
        if not sel.empty:
            _baseline(ax, sel["value"].mean(), "uniform baseline")
        if logy:
            ax.set_yscale("log")
        ax.set_ylabel(metric)
        ax.tick_params(axis="x", rotation=30)
    return grid.figure


def plot_rank(
    frame: pd.DataFrame,
    measure: str = "numerical_rank",
    x: str = "n",
    hue: str | None = "method",
    col: str | None = None,
) -> Figure:
    """Rank ``measure`` vs ``x`` (N or F) from rows with ``metric``/``value`` columns.

    A dotted diagonal ``rank = x`` marks full rank (x = N) or the kernel bound (x = F).
    """
    _check_columns(frame, ["metric", "value", x], "plot_rank")
    rows = _metric_rows(frame, measure, "plot_rank")
    fig = line_plot(rows, x, hue=hue, col=col, ylabel=measure, logy=True)
    lo, hi = float(rows[x].min()), float(rows[x].max())
    for ax in fig.axes:
        if ax.get_xlabel() or ax.lines:
            ax.plot([lo, hi], [lo, hi], ls=":", color="0.4", lw=1.2, zorder=0)
            ax.annotate(f"rank = {x}", xy=(hi, hi), ha="right", va="top", fontsize="small")
    return fig


def plot_spectra(
    frame: pd.DataFrame,
    x: str = "i",
    y: str = "sigma_ratio",
    hue: str | None = "method",
    col: str | None = None,
    col_wrap: int | None = None,
    floor: float = 1e-18,
) -> Figure:
    """Normalized singular-value spectra ``σ_i / σ_1`` vs ``i`` on log-log axes, one line per
    ``hue`` (the mean over the remaining rows, e.g. seeds), faceted by ``col``.

    Values below ``floor`` (round-off of a rank-deficient matrix) are drawn at ``floor``.
    """
    _check_columns(frame, [x, y, hue, col], "plot_spectra")
    data = frame.assign(**{y: frame[y].clip(lower=floor)}).reset_index(drop=True)
    for name in (hue, col):
        if name is not None:
            data[name] = data[name].astype(str)
    grid = sns.relplot(
        data=data,
        x=x,
        y=y,
        hue=hue,
        col=col,
        col_wrap=col_wrap if col is not None else None,
        kind="line",
        errorbar=None,
        height=3.6,
        aspect=1.25,
        facet_kws={"sharey": True, "sharex": False},
    )
    for ax in grid.axes.flat:
        ax.set(xscale="log", yscale="log", ylim=(floor / 2, 2))
        ax.grid(True, which="major", alpha=0.3)
        ax.set_ylabel("σ_i / σ_1" if y == "sigma_ratio" else y)
    return grid.figure


def plot_speed(
    frame: pd.DataFrame,
    metric: str = "time_ms",
    x: str = "n",
    hue: str = "label",
    col: str | None = "pass",
    row: str | None = "causal",
) -> Figure:
    """Time or memory vs N from :func:`benchmark_attention` (``label`` = method/backend)."""
    _check_columns(frame, ["method", "metric", "value", x], "plot_speed")
    rows = _metric_rows(frame[frame["method"] != "matmul"], metric, "plot_speed")
    if hue == "label" and "label" not in rows:  # read back from CSV, "" backends are NaN
        backend = rows["backend"].fillna("").astype(str)
        rows = rows.assign(label=rows["method"] + backend.map(lambda b: f"[{b}]" if b else ""))
    return line_plot(rows, x, hue=hue, col=col, row=row, ylabel=metric_label(metric), errorbar=None)


def plot_history(
    frame: pd.DataFrame,
    x: str = "step",
    y: str = "value",
    hue: str | None = "method",
    col: str | None = "metric",
    logy: bool = False,
) -> Figure:
    """Training curves (e.g. accuracy vs step), error bars over seeds."""
    _check_columns(frame, [x, y, hue, col], "plot_history")
    return line_plot(frame, x, y, hue=hue, col=col, logx=False, logy=logy)


def close(fig: Figure) -> None:
    """Release a figure made here (pyplot keeps references otherwise)."""
    plt.close(fig)
