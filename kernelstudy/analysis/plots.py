"""Figures from the analysis tables: each function takes a long-format frame and
returns a matplotlib Figure drawn with seaborn (the caller saves or closes it)."""

from __future__ import annotations

import math
import re
import textwrap
import warnings
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.artist import Artist
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.text import Text

from .speed import speed_labels

#: Axis labels of the metrics and columns the analyses and studies write (names with a unit
#: end in it; ``_mb`` columns hold MiB, 2**20 bytes). MSE, KL and ranks are unitless but for
#: the KL's nats.
METRIC_LABELS = {
    "time_ms": "time (ms)",
    "peak_memory_mb": "peak memory (MiB)",
    "state_mb": "state (MiB)",
    "tokens_per_s": "tokens per second",
    "kernel_mse": "kernel MSE",
    "attention_mse": "attention-matrix MSE",
    "attention_kl": "attention KL (nats)",
    "output_rel_error": "relative output error",
    "numerical_rank": "numerical rank",
    "effective_rank": "effective rank",
    "stable_rank": "stable rank",
    "val_accuracy": "validation token accuracy",
    "val_sequence_accuracy": "validation sequence accuracy",
    "val_loss": "validation loss (nats per token)",
    "sigma_ratio": r"$\sigma_i\,/\,\sigma_1$",
    "n": "sequence length N",
    "feature_dim": "feature dimension F",
    "num_features": "random features R",
    "length": "generated tokens",
    "step": "training step",
    "i": "singular value index i",
}

#: Styles of the reference lines the figures draw (each named in the legend, not on the axes).
REFERENCE_STYLE = {"color": "0.3", "ls": "--", "lw": 1.2}
DIAGONAL_STYLE = {"color": "0.4", "ls": ":", "lw": 1.2}
#: The most of the figure's height the legend beside the axes takes (in more columns if need
#: be), leaving room for a title above it.
LEGEND_HEIGHT = 0.75
#: The most of the figure's width its title takes (the figure is widened for a wider one).
TITLE_WIDTH = 0.98


def metric_label(metric: str) -> str:
    """The axis label of ``metric`` (the name itself when it has none)."""
    return METRIC_LABELS.get(metric, metric)


def wrap_title(title: str, width: int) -> str:
    """``title`` on lines of at most ``width`` characters where it can be: each line of it and
    each part of a facet title (``"row = a | col = b"``) starts a line, and one longer than
    ``width`` is broken at spaces (a word longer than ``width`` stays whole: never split inside
    a label such as ``favor(row_norms='sqrt_d')``)."""
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    lines = []
    for part in re.split(r"\n| \| ", title):
        wrapped = textwrap.wrap(part, width, break_long_words=False, break_on_hyphens=False)
        lines += wrapped or [part]
    return "\n".join(lines)


def _fit_text(text: Text, room: float) -> None:
    """Wrap ``text`` (:func:`wrap_title`) when it is wider than ``room`` pixels, at the most
    characters a line that fits it takes."""
    renderer = text.figure.canvas.get_renderer()
    title, wide = text.get_text(), text.get_window_extent(renderer).width
    if not title or wide <= room:
        return
    width = max(int(max(map(len, title.split("\n"))) * room / wide), 1)  # fit, on average
    while True:
        text.set_text(wrap_title(title, width))
        if width == 1 or text.get_window_extent(renderer).width <= room:
            return
        width -= 1


def _fit_titles(fig: Figure) -> None:
    """Wrap each axes title wider than its axes: a long facet title ran over the next
    facet's or over the legend beside the grid."""
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        _fit_text(ax.title, 0.95 * ax.get_window_extent(renderer).width)


def figure_title(fig: Figure, title: str) -> Text:
    """Set ``fig``'s title (suptitle), widening the figure to it where it is wider: it ran
    past both edges, and saved with ``bbox_inches="tight"`` the layout was redone for the
    wider canvas, leaving a gap between the axes and the legend. The text stays as given
    (break its lines with ``\\n``)."""
    text = fig.suptitle(title)
    wide = text.get_window_extent(fig.canvas.get_renderer()).width / TITLE_WIDTH
    if wide > fig.bbox.width:
        fig.set_figwidth(wide / fig.dpi)
    return text


def _legend_outside(
    fig: Figure,
    legend=None,
    extra: Mapping[str, Artist] | None = None,
    title: str | None = None,
) -> None:
    """Put the figure's entries (those of ``legend``, else of the figure's own legend, plus
    ``extra``: label -> handle, e.g. a reference line) in one legend outside the axes, on
    the right, under constrained layout: seaborn's legend beside the grid was placed before
    facet titles were known, and a long title of the right column ran into it; a label
    annotated on a reference line lay over the data."""
    legend = legend if legend is not None else (fig.legends[0] if fig.legends else None)
    renderer = fig.canvas.get_renderer()
    handles, labels, before = [], [], 0.0
    if legend is not None:
        before = legend.get_window_extent(renderer).width  # the figure was widened for it
        handles = list(legend.legend_handles)
        labels = [t.get_text() for t in legend.get_texts()]
        if title is None:
            title = legend.get_title().get_text() or None
        legend.remove()
    for label, handle in (extra or {}).items():
        if label not in labels:
            handles.append(handle)
            labels.append(label)
    fig.set_layout_engine("constrained")
    if not handles:
        return
    kwargs = {"loc": "outside right center", "title": title, "frameon": False}
    new = fig.legend(handles, labels, **kwargs)
    # centred on the figure, a legend taller than 3/4 of it reached into a figure title
    # (two lines) over the grid: as many columns as bring it under that
    room = LEGEND_HEIGHT * fig.bbox.height
    tall = new.get_window_extent(renderer).height
    if tall > room:
        new.remove()
        new = fig.legend(handles, labels, ncols=math.ceil(tall / room), **kwargs)
    sns.utils.adjust_legend_subtitles(new)  # seaborn's hue/style subheadings, as it draws them
    # wider than the legend the figure was widened for: widen it more, not squeeze the axes
    after = new.get_window_extent(renderer).width
    if after > before:
        fig.set_figwidth(fig.get_figwidth() + (after - before) / fig.dpi)


def _reference_handle(style: Mapping, label: str) -> Line2D:
    return Line2D([], [], label=label, **style)


def _check_columns(frame: pd.DataFrame, columns: Sequence[str | None], what: str) -> None:
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"frame must be a pandas DataFrame, got {type(frame).__name__}")
    missing = [c for c in columns if c is not None and c not in frame.columns]
    if missing:
        raise ValueError(f"{what}: frame lacks columns {missing} (has {list(frame.columns)})")
    if frame.empty:
        raise ValueError(f"{what}: frame is empty")


def _metric_rows(frame: pd.DataFrame, metric: str, what: str) -> pd.DataFrame:
    """The rows of ``metric`` with a finite ``value``; ValueError naming it when none.
    NaN (a metric that does not apply) is left out silently; an infinite value (a run that
    diverged) is left out with a warning naming its rows: the mean drawn at its point is
    then over the finite rows only, and looked better than the run was."""
    rows = frame[frame["metric"] == metric]
    values = pd.to_numeric(rows["value"], errors="coerce")
    infinite = rows[np.isinf(values)]
    if not infinite.empty:
        named = [c for c in infinite.columns if c not in ("value", "metric", "config_id")]
        first = infinite.iloc[0][named[:6]].to_dict()
        warnings.warn(
            f"{what}: {len(infinite)} infinite value(s) of {metric!r} not drawn (the points "
            f"they belong to show the finite rows only), e.g. {first}",
            RuntimeWarning,
            stacklevel=3,
        )
    rows = rows[np.isfinite(values)]
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
    xlabel: str | None = None,
    legend_title: str | None = None,
    logy_base: float = 10,
    col_ylabels: bool = False,
    hue_order: Sequence[str] | None = None,
    estimator: str = "mean",
) -> Figure:
    """Mean of ``y`` vs ``x`` (error bars over the remaining rows, e.g. seeds), faceted.

    ``hlines``: rows with ``y`` (and the ``col``/``row`` facet columns) drawn as dashed
    reference lines in the matching facet, e.g. a baseline, with ``hline_label`` in the
    legend: horizontal at their mean, or their mean at each ``x`` where they have ``x``
    values and differ by them (ValueError where they differ by a hue or style column).
    Axis labels default to :func:`metric_label` of ``x`` and ``y``; the legend (title:
    ``legend_title``, else the hue column's name) is outside the axes, and facet titles
    wider than their axes are wrapped. ``col_ylabels``: each facet's y label is
    :func:`metric_label` of its ``col`` value, in place of its title (``col="metric"``: one
    metric per facet). ``hue_order``: the hue values in colour order (give every figure of
    a set the same one, so a value keeps its colour where another has no rows). Values
    that a log axis cannot show (0 or below) are named in a warning (matplotlib drops
    them without a word). ``estimator``: ``"mean"``, or ``"geometric"``: the geometric mean,
    with ``errorbar=("sd", k)`` read as ×/÷ the geometric sd to the k-th power (the spread of
    positive values spanning decades, on a log axis: an arithmetic sd there reached below
    zero, off the axis, and single seeds set the means).
    """
    _check_columns(frame, [x, y, hue, style, col, row], "line_plot")
    if estimator not in ("mean", "geometric"):
        raise ValueError(f"estimator must be 'mean' or 'geometric', got {estimator!r}")
    data = frame.reset_index(drop=True)  # seaborn needs unique labels (pd.concat repeats them)
    for name in (hue, style, col, row):
        if name is not None:
            data[name] = data[name].astype(str)
    if estimator == "geometric":
        if not (pd.to_numeric(data[y], errors="coerce") > 0).all():
            raise ValueError(f"line_plot: a geometric mean needs {y} > 0 in every row")
        errorbar = _geometric_errorbar(errorbar)
    for axis, column, log in (("x", x, logx), ("y", y, logy)):
        values = pd.to_numeric(data[column], errors="coerce")
        if log and (values <= 0).any():
            warnings.warn(
                f"line_plot: {int((values <= 0).sum())} row(s) with {column} <= 0 are not "
                f"shown on the log {axis} axis (e.g. {values[values <= 0].iloc[0]}); pass "
                f"log{axis}=False to show them",
                RuntimeWarning,
                stacklevel=2,
            )
    with warnings.catch_warnings():
        # a line of one point has no error bar: seaborn hands matplotlib NaN bounds, which
        # pandas 2 (float() of a one-element Series) and matplotlib 3.7 (all-NaN min) warn of
        warnings.filterwarnings("ignore", "Calling float on a single element", FutureWarning)
        warnings.filterwarnings("ignore", "All-NaN axis encountered", RuntimeWarning)
        grid = sns.relplot(
            data=data,
            x=x,
            y=y,
            hue=hue,
            **_fixed_colours(data, hue, hue_order),
            style=style,
            col=col,
            row=row,
            kind="line",
            marker="o",
            estimator=_geometric_mean if estimator == "geometric" else "mean",
            errorbar=errorbar,
            err_style="bars",
            height=3.6,
            aspect=1.25,
            facet_kws={"sharey": False, "sharex": False},
        )
    extra = {}
    for (row_val, col_val), ax in _facets(grid, row, col):
        if hlines is not None and not hlines.empty:
            sel = hlines
            if col is not None and col in hlines:
                sel = sel[sel[col].astype(str) == col_val]
            if row is not None and row in hlines:
                sel = sel[sel[row].astype(str) == row_val]
            if not sel.empty:
                extra[hline_label] = _facet_baseline(ax, sel, x, y, (hue, style), hline_label)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log", base=logy_base)
        ax.grid(True, which="major", alpha=0.3)
    grid.set_axis_labels(
        xlabel or metric_label(x), ylabel or (metric_label(y) if y != "value" else y)
    )
    if col_ylabels and col is not None:
        for (_, col_val), ax in _facets(grid, row, col):
            ax.set_ylabel(metric_label(col_val))
            if row is None:
                ax.set_title("")
    _fit_titles(grid.figure)
    _legend_outside(grid.figure, grid.legend, extra, title=legend_title)
    if title:
        figure_title(grid.figure, title)
    return grid.figure


def _geometric_mean(values: pd.Series) -> float:
    return float(np.exp(np.log(values).mean()))


def _geometric_errorbar(errorbar: str | tuple | None):
    """``("sd", k)`` (or ``"sd"``) as seaborn's errorbar callable: (g / s^k, g · s^k) with
    g the geometric mean and s the geometric sd (exp of the sd of the logs, ddof 1); None
    stays None."""
    if errorbar is None:
        return None
    name, k = (errorbar, 1.0) if isinstance(errorbar, str) else errorbar
    if name != "sd":
        raise ValueError(
            f"a geometric estimator takes errorbar ('sd', k) or None, got {errorbar!r}"
        )

    def interval(values: pd.Series) -> tuple[float, float]:
        logs = np.log(values)
        centre = logs.mean()
        half = k * (logs.std(ddof=1) if len(logs) > 1 else 0.0)
        return float(np.exp(centre - half)), float(np.exp(centre + half))

    return interval


def _fixed_colours(data: pd.DataFrame, hue: str | None, order: Sequence | None) -> dict:
    """seaborn's ``hue_order`` and ``palette`` giving each value of ``order`` the colour of
    its place there, whether or not the others have rows (the legend lists those that do)."""
    if hue is None or order is None:
        return {}
    order = [str(h) for h in order]
    missing = sorted(set(data[hue]) - set(order))
    if missing:
        raise ValueError(f"line_plot: hue_order lacks {hue} values {missing}")
    palette = dict(zip(order, sns.color_palette(n_colors=len(order)), strict=True))
    present = [h for h in order if h in set(data[hue])]
    return {"hue_order": present, "palette": {h: palette[h] for h in present}}


def _facet_baseline(
    ax, rows: pd.DataFrame, x: str, y: str, split: Sequence[str | None], label: str
) -> Line2D:
    """``rows``' reference line in a facet: the mean of ``y``, dashed, horizontal, or over
    ``x`` where its means differ by ``x`` (a baseline that changes with N is not its mean
    over N). ValueError where it changes with a hue or style column (one dashed line cannot
    show which is whose)."""
    for name in split:
        if name is not None and name in rows and rows[name].astype(str).nunique() > 1:
            means = rows.groupby(rows[name].astype(str))[y].mean()
            if not np.allclose(means, means.iloc[0], rtol=1e-12, atol=0):  # not the last bits
                raise ValueError(
                    f"hlines: the reference {y!r} differs by {name!r} ({name} being a hue or "
                    f"style column) within a facet: facet by {name!r} (col= or row=), or "
                    "average the reference first"
                )
    if x in rows:
        per_x = rows.dropna(subset=[x]).groupby(x)[y].mean()
        if len(per_x) > 1 and not np.allclose(per_x, per_x.iloc[0], rtol=1e-12, atol=0):
            ax.plot(per_x.index, per_x.to_numpy(), **REFERENCE_STYLE)
            return _reference_handle(REFERENCE_STYLE, label)
    return _baseline(ax, rows[y].mean(), label)


def _baseline(ax, value: float, label: str) -> Line2D:
    """A dashed horizontal reference line (named in the legend, not on the axes, where the
    label lay over the data); its legend handle."""
    ax.axhline(value, **REFERENCE_STYLE)
    return _reference_handle(REFERENCE_STYLE, label)


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
    estimator: str = "mean",
) -> Figure:
    """Error ``metric`` vs ``x`` from :func:`approximation_error` rows (plus config columns),
    faceted by ``col`` and ``row``: ``estimator`` (``"mean"`` ± 1 sd, or ``"geometric"``
    mean ×/÷ 1 geometric sd: see :func:`line_plot`) over the remaining rows, e.g. seeds.

    Rows with ``method == "uniform"`` become a dashed baseline per facet ("uniform
    attention" in the legend), over ``x`` where it changes with ``x`` (e.g. ``x="n"``).
    """
    _check_columns(frame, ["method", "metric", "value", x], "plot_approximation")
    rows = _metric_rows(frame, metric, "plot_approximation")
    maps, base = rows[rows["method"] != "uniform"], rows[rows["method"] == "uniform"]
    return line_plot(
        maps,
        x,
        hue=hue,
        style=style,
        col=col,
        row=row,
        hlines=base,
        hline_label="uniform attention",
        ylabel=metric_label(metric),
        title=None,
        estimator=estimator,
    )


def plot_map_comparison(
    frame: pd.DataFrame,
    metric: str = "attention_kl",
    x: str = "method",
    hue: str | None = "stage",
    col: str | None = None,
    logy: bool = True,
) -> Figure:
    """Bars of ``metric`` per map (mean, error bars over seeds); ``uniform`` as a dashed line
    ("uniform attention" in the legend, outside the axes)."""
    _check_columns(frame, ["method", "metric", "value", x, hue, col], "plot_map_comparison")
    rows = _metric_rows(frame, metric, "plot_map_comparison")
    maps, base = rows[rows["method"] != "uniform"], rows[rows["method"] == "uniform"]
    # bars (and hues, by first appearance) in the order of x, not of the rows: a map whose
    # rows were recomputed, appended at the table's end, moved to the figure's end
    data = maps.sort_values(x, kind="stable").reset_index(drop=True)  # unique labels
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
    extra = {}
    for (_, col_val), ax in _facets(grid, None, col):
        sel = base if col is None or col not in base else base[base[col].astype(str) == col_val]
        if not sel.empty:
            extra["uniform attention"] = _baseline(ax, sel["value"].mean(), "uniform attention")
        if logy:
            ax.set_yscale("log")
        ax.grid(True, axis="y", which="major", alpha=0.3)
        # anchored at their right end, under their bar (centred, they leaned into the next)
        for label in ax.get_xticklabels():
            label.set(rotation=30, ha="right", rotation_mode="anchor")
    grid.set_axis_labels(metric_label(x) if x != "method" else "map", metric_label(metric))
    _fit_titles(grid.figure)
    _legend_outside(grid.figure, grid.legend, extra)
    return grid.figure


def plot_rank(
    frame: pd.DataFrame,
    measure: str = "numerical_rank",
    x: str = "n",
    hue: str | None = "method",
    col: str | None = None,
) -> Figure:
    """Rank ``measure`` vs ``x`` (N or F) from rows with ``metric``/``value`` columns, on
    base-2 log axes (ranks of power-of-2 sizes read off as such).

    A dotted line marks full rank ``rank = N`` (x = N) or the kernel bound (x = F):
    ``rank = min(F, N)`` where the rows hold one N (an N×N matrix has rank at most N),
    else ``rank = F``; named in the legend.
    """
    _check_columns(frame, ["metric", "value", x], "plot_rank")
    rows = _metric_rows(frame, measure, "plot_rank")
    fig = line_plot(rows, x, hue=hue, col=col, ylabel=metric_label(measure), logy_base=2)
    lo, hi = float(rows[x].min()), float(rows[x].max())
    label = {"n": "rank = N (full rank)", "feature_dim": "rank = F (kernel bound)"}
    label = label.get(x, f"rank = {x}")
    cap = hi  # the line is y = min(x, cap)
    if x == "feature_dim" and "n" in rows and rows["n"].nunique() == 1:
        cap = float(rows["n"].iloc[0])
        label = "rank = min(F, N) (kernel bound)"
    xs = sorted({lo, hi, min(max(cap, lo), hi)})
    for ax in fig.axes:
        ax.plot(xs, [min(v, cap) for v in xs], zorder=0, **DIAGONAL_STYLE)
    _legend_outside(fig, extra={label: _reference_handle(DIAGONAL_STYLE, label)})
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
    grid.set_axis_labels(metric_label(x), metric_label(y))
    _fit_titles(grid.figure)
    _legend_outside(grid.figure, grid.legend)
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
    if hue == "label" and "label" not in rows:  # as the speed study labels its rows
        rows = rows.assign(label=speed_labels(rows))
    return line_plot(
        rows,
        x,
        hue=hue,
        col=col,
        row=row,
        ylabel=metric_label(metric),
        errorbar=None,
        legend_title="method [backend]" if hue == "label" else None,
    )


def plot_history(
    frame: pd.DataFrame,
    x: str = "step",
    y: str = "value",
    hue: str | None = "method",
    col: str | None = "metric",
    logy: bool = False,
) -> Figure:
    """Training curves (e.g. accuracy vs step), error bars over seeds; with ``col="metric"``
    each facet's y axis is named by its metric. The default ``hue="method"`` applies where
    the frame has that column (one map's history, as ``fit_to_softmax`` returns, has
    none: one line per facet); a ``hue`` given otherwise must be a column."""
    if hue == "method" and "method" not in frame.columns:
        hue = None
    _check_columns(frame, [x, y, hue, col], "plot_history")
    return line_plot(
        frame, x, y, hue=hue, col=col, logx=False, logy=logy, col_ylabels=col == "metric"
    )


def close(fig: Figure) -> None:
    """Release a figure made here (pyplot keeps references otherwise)."""
    plt.close(fig)
