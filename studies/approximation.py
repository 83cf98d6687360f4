"""Softmax approximation error: MSE vs number of random features (iid vs orthogonal), and every
registered feature map at a matched feature dimension, against the uniform-attention baseline."""

from __future__ import annotations

import copy
import math

import numpy as np
import pandas as pd
import torch
from scipy import stats

import kernelstudy as ks
from kernelstudy.arguments import check_count
from kernelstudy.study import (
    check_map_builds,
    check_map_list,
    check_names,
    check_params,
    main,
    map_name_and_hparams,
    markdown_table,
    matched_map,
    not_run_section,
)

PERFORMER_METRICS = ("kernel_mse", "attention_mse")


#: The kinds of the config's plain entries (:func:`kernelstudy.study.check_params`).
PARAMS = {
    "seq_len": "count",
    "value_dim": "count",
    "head_dims": "counts",
    "stds": "positives",
    "num_features": "counts",
    "map_stds": "positives",
    "map_feature_dim": "count",
    "fit_steps": "count0",
    "fit_batch": "count",
    "fit_lr": "positive",
}


def configs(params: dict) -> list[dict]:
    """Part "performer": one config per (map, D, std, R, orthogonal), seeds inside.
    Part "maps": one config per (map, std, seed): every registered map not in
    ``exclude_maps``, then every map of ``extra_maps`` (:func:`extra_maps`).

    A map given by name is its name in ``map`` (the committed rows' ids); a table is its
    label, e.g. ``"favor(orthogonal=False)"``: CSV column, ``--only`` and id alike."""
    check_params(params, PARAMS)
    out = []
    # 0 seeds left a part without configs (or failed later as "No objects to concatenate")
    seeds = check_count("seeds", params["seeds"], 1)
    map_seeds = check_count("map_seeds", params["map_seeds"], 1)
    maps = ks.list_feature_maps()
    excluded = check_names("exclude_maps", params["exclude_maps"], maps)
    for name in performer_maps(params):
        for d in params["head_dims"]:
            for std in params["stds"]:
                for r in params["num_features"]:
                    for orthogonal in (False, True):
                        out.append(
                            {
                                "part": "performer",
                                "map": name,
                                "head_dim": d,
                                "std": std,
                                "num_features": r,
                                "orthogonal": orthogonal,
                                "seeds": seeds,
                                "n": params["seq_len"],
                            }
                        )
    for name in [m for m in maps if m not in excluded] + extra_maps(params):
        for std in params["map_stds"]:
            for seed in range(map_seeds):
                out.append(
                    {
                        "part": "maps",
                        "map": name,
                        "head_dim": params["head_dims"][0],
                        "std": std,
                        "target_feature_dim": params["map_feature_dim"],
                        "seed": seed,
                        "n": params["seq_len"],
                        "value_dim": params["value_dim"],
                        "fit_steps": params["fit_steps"],
                        "fit_batch": params["fit_batch"],
                        "fit_lr": params["fit_lr"],
                    }
                )
    return out


#: Hyperparameters a ``performer_maps`` table may not set: the performer part sets them.
PERFORMER_SETS = {
    "orthogonal": "the performer part runs every R with iid and with orthogonal features",
    "seed": "the performer part draws new features per seed",
    "stabilize": "the performer part runs random maps with their stabilizer off (it rescales "
    "φ, which would spoil the kernel MSE)",
}


def performer_maps(params: dict) -> list[str]:
    """The labels of ``performer_maps``: random-feature maps by name or as tables of a name
    and hyperparameters (not the size, ``orthogonal``, ``seed`` or ``stabilize``: the part
    sets them), each built at every head dimension before any run."""
    labels = check_map_list(
        "performer_maps",
        params["performer_maps"],
        study_sets=PERFORMER_SETS,
        size="the performer part sweeps R (num_features) through it",
    )
    for i, label in enumerate(labels):
        for d in params["head_dims"]:
            for orthogonal in (False, True):
                check_map_builds(
                    f"performer_maps[{i}]",
                    lambda d=d, o=orthogonal, label=label: _random_map(
                        label, d, min(params["num_features"], default=1), o, seed=0
                    ),
                )
    return labels


def extra_maps(params: dict) -> list[str]:
    """The labels of ``extra_maps`` (absent: none): maps the "maps" part compares beside
    the registered ones, as tables of a name and hyperparameters or ``"module:Class"`` names.
    Each is matched to F = ``map_feature_dim`` through its size hyperparameter, as the
    registered maps are, so a table that sets that (or ``seed``: each seed's own) is refused,
    as is a registered map by its name alone (the part has it, unless ``exclude_maps`` names
    it) and one map twice; each is built before any run."""
    labels = check_map_list(
        "extra_maps",
        params.get("extra_maps", []),
        study_sets={"seed": "the maps part draws each seed's own features"},
        size="the maps part matches every map to F = map_feature_dim through it",
        registered="the maps part has unless exclude_maps names it (take it out of "
        "exclude_maps to add it); extra_maps adds tables with hyperparameters and "
        "'module:Class' maps",
    )
    d, f = params["head_dims"][0], params["map_feature_dim"]
    for i, label in enumerate(labels):
        check_map_builds(f"extra_maps[{i}]", lambda label=label: matched_map(label, d, f))
    return labels


def _random_map(label: str, head_dim: int, num_features: int, orthogonal: bool, seed: int):
    """The random-feature map of a ``performer_maps`` label with R = ``num_features``."""
    name, hparams = map_name_and_hparams(label)
    return ks.analysis.random_feature_map(
        name, head_dim, num_features, orthogonal=orthogonal, seed=seed, **hparams
    )


def _labelled(frame: pd.DataFrame, label: str) -> pd.DataFrame:
    """``approximation_error`` rows with the map's rows' ``method`` set to the config's map
    label: it names the registry name only, so favor(orthogonal=False) and favor (or a
    "module:Class" map of a registered class) were one method in the summary's table."""
    return frame.assign(method=frame["method"].where(frame["kind"] != "map", label))


def _data(config: dict, seed: int, device: str, stream: int, batch: int = 1):
    """Queries/keys (and values) of one seed; data seeds never coincide with feature seeds."""
    n, d, data_seed = config["n"], config["head_dim"], 10_000 * stream + seed
    q, k = ks.analysis.gaussian_qk(n, d, config["std"], batch, seed=data_seed, device=device)
    gen = torch.Generator().manual_seed(data_seed)
    v = torch.randn(batch, 1, n, config.get("value_dim", d), generator=gen).to(device)
    return q, k, v


def run_config(config: dict, device: str) -> pd.DataFrame:
    if config["part"] == "performer":
        return _run_performer(config, device)
    return _run_map(config, device)


def _run_performer(config: dict, device: str) -> pd.DataFrame:
    frames = []
    for seed in range(config["seeds"]):
        q, k, _ = _data(config, seed, device, stream=1)
        fm = _random_map(
            config["map"],
            config["head_dim"],
            config["num_features"],
            orthogonal=config["orthogonal"],
            seed=seed,
        ).to(device)
        frame = _labelled(ks.analysis.approximation_error(fm, q, k), config["map"])
        frames.append(frame.assign(seed=seed))
    return pd.concat(frames, ignore_index=True)


#: The stage of a learned map fitted without its own penalty (``regularization()``).
UNPENALIZED = "fitted, no penalty"


def has_penalty(feature_map: torch.nn.Module) -> bool:
    """Whether ``feature_map`` adds a penalty of its own to a fit: its class overrides
    ``regularization`` and its ``reg_weight`` hyperparameter, where it has one, is not 0
    (softplus_ffn, oglu and aoglu: ``reg_weight``·‖WᵀW − I‖²)."""
    own = type(feature_map).regularization is not ks.FeatureMap.regularization
    return own and getattr(feature_map, "hparams", {}).get("reg_weight", 1.0) != 0


def _run_map(config: dict, device: str) -> pd.DataFrame:
    seed = config["seed"]
    fm = matched_map(config["map"], config["head_dim"], config["target_feature_dim"], seed)
    fm = fm.to(device)
    kind = ks.analysis.map_kind(fm)
    q, k, v = _data(config, seed, device, stream=2)  # held-out evaluation data
    frames = []
    if kind == "learned":
        frames.append(ks.analysis.approximation_error(fm, q, k, v).assign(stage="init"))
        q_fit, k_fit, _ = _data(config, seed, device, stream=3, batch=config["fit_batch"])
        # with its own penalty (Yorsh & Kovalenko's orthogonality term), as it is trained, and
        # from the same init without it: what the map can represent, beside what it learns
        fits = {"fitted": fm}
        if has_penalty(fm):
            fits[UNPENALIZED] = copy.deepcopy(fm)
        for stage, fitted in fits.items():
            torch.manual_seed(seed)
            ks.analysis.fit_to_softmax(
                fitted,
                q_fit,
                k_fit,
                steps=config["fit_steps"],
                lr=config["fit_lr"],
                reg_weight=1.0 if stage == "fitted" else 0.0,
                eval_every=10**9,
            )
            frames.append(ks.analysis.approximation_error(fitted, q, k, v).assign(stage=stage))
    else:
        frames.append(ks.analysis.approximation_error(fm, q, k, v).assign(stage=kind))
    return _labelled(pd.concat(frames, ignore_index=True), config["map"]).assign(kind_of_map=kind)


# --- summary and figures ------------------------------------------------------------------------


def _mean_sd(values: pd.Series) -> str:
    if len(values) == 0:  # that kind was not run (e.g. ``--only orthogonal=False``)
        return "–"
    if len(values) < 2:
        return f"{values.mean():.3g}"
    with np.errstate(invalid="ignore"):  # an inf MSE: the sd is NaN
        return f"{values.mean():.3g} ± {values.std(ddof=1):.2g}"


def _paired_mses(group: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, pd.Index]:
    """Per seed with both kinds: the orthogonal and the iid MSE (same data per seed), and the
    seeds."""
    maps = group[group["method"] != "uniform"]
    orthogonal = maps["orthogonal"].astype(str) == "True"
    iid = maps[~orthogonal].groupby("seed")["value"].mean()
    orth = maps[orthogonal].groupby("seed")["value"].mean()
    both = iid.index.intersection(orth.index)
    return orth[both].to_numpy(float), iid[both].to_numpy(float), both


def _paired_log_ratios(group: pd.DataFrame) -> pd.Series:
    """Per seed, log(orthogonal MSE / iid MSE): the two share the seed's data, so the pair
    cancels most of the data's variance (the MSE is heavy-tailed: one iid draw in hundreds
    lands 10⁹ above the median, which decides a mean over 10 seeds)."""
    orth, iid, seeds = _paired_mses(group)
    with np.errstate(divide="ignore", invalid="ignore"):  # an MSE of 0 or inf: ±inf or NaN
        return pd.Series(np.log(orth) - np.log(iid), seeds)


def _ratio_of_means(group: pd.DataFrame, resamples: int = 2000) -> str:
    """mean(orthogonal MSE) / mean(iid MSE) over the paired seeds, the ratio of expected MSEs
    that the Performer's theorem bounds, with a ~95% percentile interval from resampling the
    seeds (pairs kept together; a fixed generator, so the text is reproducible)."""
    a, b, seeds = _paired_mses(group)
    if len(seeds) < 2 or not (np.isfinite(a).all() and np.isfinite(b).all()) or b.sum() <= 0:
        return "–"
    picks = np.random.default_rng(0).integers(0, len(seeds), size=(resamples, len(seeds)))
    with np.errstate(divide="ignore", invalid="ignore"):
        boot = a[picks].mean(1) / b[picks].mean(1)
    lo, hi = np.nanpercentile(boot, [2.5, 97.5])
    return f"{a.mean() / b.mean():.3g} [{lo:.3g}, {hi:.3g}]"


def _interval(d: pd.Series) -> tuple[float, float, float]:
    """Mean of ``d`` and its 95% Student t interval; all NaN where a value is not finite (an
    MSE of 0 or inf: no interval says which kind is lower), bounds NaN below 2 values. (± 2
    standard errors, as before, covers 82% at 3 seeds, 88% at 5.)"""
    if not np.isfinite(d).all():
        return math.nan, math.nan, math.nan
    if len(d) < 2:
        return float(d.mean()), math.nan, math.nan
    half = _t_quantile(len(d)) * d.std(ddof=1) / math.sqrt(len(d))
    return float(d.mean()), float(d.mean() - half), float(d.mean() + half)


def _t_quantile(n: int, tests: int = 1, level: float = 0.95) -> float:
    """Two-sided Student t quantile for a mean of ``n`` values, Bonferroni-adjusted over
    ``tests`` intervals (each at level ``1 − (1 − level)/tests``): NaN below 2 values."""
    if n < 2:
        return math.nan
    return float(stats.t.ppf(1 - (1 - level) / (2 * max(tests, 1)), n - 1))


def performer_table(frame: pd.DataFrame, metric: str = "attention_mse") -> pd.DataFrame:
    """Per (map, D, std, R): iid and orthogonal mean ± sd over seeds, uniform's MSE, the
    paired ratio orth/iid (the geometric mean over seeds with its 95% t interval), and
    whether each kind's MSE is below uniform's (:func:`_beats_uniform`, paired by seed)."""
    perf = frame[(frame["part"] == "performer") & (frame["metric"] == metric)]
    rows = []
    keys = ["map", "head_dim", "std", "num_features"]
    for key, group in perf.groupby(keys):
        maps = group[group["method"] != "uniform"]
        uniform = group[group["method"] == "uniform"]["value"].mean()
        orthogonal = maps["orthogonal"].astype(str) == "True"
        iid, orth = maps[~orthogonal]["value"], maps[orthogonal]["value"]
        ratios = _paired_log_ratios(group)
        mean, lo, hi = _interval(ratios)
        uniform_by_seed = group[group["method"] == "uniform"].groupby("seed")["value"].mean()
        paired = f"{math.exp(mean):.3g} [{math.exp(lo):.3g}, {math.exp(hi):.3g}]"
        if len(ratios) == 0:  # no seed has both kinds
            paired = "–"
        elif len(ratios) == 1 and np.isfinite(ratios).all():
            paired = f"{math.exp(mean):.3g} (1 seed: no interval)"
        elif not np.isfinite(ratios).all():
            paired = f"– ({int((~np.isfinite(ratios)).sum())} seeds with an MSE of 0 or inf)"
        row = dict(zip(keys, key, strict=True))
        row.update(
            {
                "iid": _mean_sd(iid),
                "orthogonal": _mean_sd(orth),
                "orth/iid": paired,
                "ratio of means": _ratio_of_means(group),
                "uniform": uniform,
                "iid_mean": iid.mean(),
                "orth_mean": orth.mean(),
                "log_ratio": mean,
                "log_ratio_lo": lo,
                "log_ratio_hi": hi,
                # for intervals at other levels (the verdict's, simultaneous over R)
                "log_ratio_sd": (
                    float(ratios.std(ddof=1))
                    if len(ratios) > 1 and np.isfinite(ratios).all()
                    else math.nan
                ),
                "paired_seeds": len(ratios),
                "iid beats uniform": _beats_uniform_if_run(maps[~orthogonal], uniform_by_seed),
                "orthogonal beats uniform": _beats_uniform_if_run(
                    maps[orthogonal], uniform_by_seed
                ),
            }
        )
        rows.append(row)
    return pd.DataFrame(rows)


def _beats_uniform_if_run(maps: pd.DataFrame, uniform: pd.Series) -> str:
    """:func:`_beats_uniform` of one feature kind's per-seed MSEs; "–" where it has no rows."""
    if maps.empty:
        return "–"
    return _beats_uniform(maps.groupby("seed")["value"].mean(), uniform)


def smallest_r_beating_uniform(table: pd.DataFrame) -> pd.DataFrame:
    """Per (map, D, std) and feature kind: the smallest R whose MSE is below uniform's by
    :func:`_beats_uniform` (paired by seed, the 95% t interval of the per-seed log ratio below
    0; with one seed by sign, and marked so), among the R that kind was run at; "> R_max" when
    at none; "–" when it has no rows. (It compared the means over seeds, without an interval:
    one seed's luck could decide a row.)"""
    rows = []
    for (name, d, std), group in table.groupby(["map", "head_dim", "std"]):
        group = group.sort_values("num_features")
        row = {"map": name, "D": d, "std": std, "uniform MSE": group["uniform"].iloc[0]}
        for label in ("iid", "orthogonal"):
            # only the R this kind was run at (a run with --only may have left some out)
            measured = group[group[f"{label} beats uniform"] != "–"]
            beats = measured[measured[f"{label} beats uniform"].str.startswith("yes")]
            if len(beats):
                first = beats.iloc[0]
                r = int(first.num_features)
                by_sign = "1 seed" in first[f"{label} beats uniform"]
                row[f"smallest R, {label}"] = f"{r} (1 seed: by sign)" if by_sign else r
            elif len(measured):
                row[f"smallest R, {label}"] = f"> {int(measured.num_features.max())}"
            else:
                row[f"smallest R, {label}"] = "–"  # not run yet: no verdict
        rows.append(row)
    return pd.DataFrame(rows)


def _beats_uniform(error: pd.Series, uniform: pd.Series) -> str:
    """Whether a map's error (its attention KL or MSE, per seed) is below uniform attention's,
    paired by seed (each seed's data is shared by every map): "yes"/"no" where the 95% t
    interval of the per-seed log ratio map/uniform excludes 0, else "not resolved"; a single
    seed is compared as is (no spread to measure) and marked so, as is a verdict on an error
    of 0 or inf (its sign); "–" where a seed's error is undefined (signed maps have no KL: no
    distribution to compare)."""
    both = error.index.intersection(uniform.index)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.log(error[both].to_numpy(float)) - np.log(uniform[both].to_numpy(float))
    if len(d) == 0 or np.isnan(d).any():
        return "–"
    if len(d) == 1 or np.isinf(d).any():  # one seed, or an error of 0 or inf: the sign decides
        sign = "yes" if (d < 0).all() else "no" if (d > 0).all() else "not resolved"
        return f"{sign} ({'1 seed' if len(d) == 1 else 'an error of 0 or inf'}: by sign)"
    half = _t_quantile(len(d)) * d.std(ddof=1) / math.sqrt(len(d))
    return _sign(d.mean() - half, d.mean() + half, "yes", "no")


def _mean_of_all(values: pd.Series) -> float:
    """The mean of ``values``, NaN if any is NaN (pandas' mean skips them)."""
    return float(values.mean()) if values.notna().all() else math.nan


def maps_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Every map at matched F: mean over seeds of each attention metric, with the uniform row,
    and whether the map's KL is below uniform's (:func:`_beats_uniform`). A mean is NaN where
    any seed's value is (a signed map's KL, undefined on a seed where a row has a negative
    weight): the mean of the other seeds would be of fewer seeds than the table states, and
    of those picked by their data."""
    maps = frame[frame["part"] == "maps"].copy()
    if maps.empty:
        return pd.DataFrame()
    maps["stage"] = maps["stage"].where(maps["method"] != "uniform", "baseline")
    maps["F"] = maps["feature_dim"].map(lambda f: "–" if pd.isna(f) else str(int(f)))
    metrics = ["attention_mse", "attention_kl", "output_rel_error"]
    keys = ["std", "method", "stage", "F", "metric"]
    table = (  # the mean over seeds of each seed's mean (uniform has a row per map run)
        maps[maps["metric"].isin(metrics)]
        .groupby([*keys, "seed"])["value"]
        .mean()
        .groupby(keys)
        .agg(_mean_of_all)
        .unstack("metric")
        .reset_index()
    )
    kl = maps[maps["metric"] == "attention_kl"]
    per_seed = kl.groupby(["std", "method", "stage", "F", "seed"])["value"].mean()
    uniform = kl[kl["method"] == "uniform"].groupby(["std", "seed"])["value"].mean()

    def verdict(s: float, m: str, st: str, f: str) -> str:
        if m == "uniform" or (s, m, st, f) not in per_seed.index.droplevel("seed"):
            return "–"
        if s not in uniform.index.get_level_values("std"):
            return "–"
        return _beats_uniform(per_seed.loc[(s, m, st, f)], uniform.loc[s])

    table["beats uniform (KL)"] = [
        verdict(*key)
        for key in zip(table["std"], table["method"], table["stage"], table["F"], strict=True)
    ]
    order = {"baseline": 0, "fixed": 1, "random": 2, "init": 3, "fitted": 4, UNPENALIZED: 5}
    table["_order"] = table["stage"].map(order)
    table = table.sort_values(["std", "_order", "attention_kl"]).drop(columns="_order")
    return table[["std", "method", "stage", "F", *metrics, "beats uniform (KL)"]]


def _slope(group: pd.DataFrame) -> tuple[float, float, float]:
    """Slope of log MSE on log R with its 95% interval: the mean over seeds of each seed's
    least-squares slope, with the Student t interval of that mean (the rows of one seed
    share its data, so they are not independent). The Performer bound gives −1."""
    slopes = []
    for _, rows in group.groupby("seed"):
        x = np.log(rows["num_features"].astype(float).to_numpy())
        y = np.log(rows["value"].astype(float).to_numpy())
        keep = np.isfinite(y)
        x, y = x[keep], y[keep]
        if len(np.unique(x)) < 2:
            continue
        xc = x - x.mean()
        slopes.append(float((xc * (y - y.mean())).sum() / (xc**2).sum()))
    if len(slopes) < 2:
        return math.nan, math.nan, math.nan
    mean = float(np.mean(slopes))
    half = _t_quantile(len(slopes)) * float(np.std(slopes, ddof=1)) / math.sqrt(len(slopes))
    return mean, mean - half, mean + half


def _sign(lo: float, hi: float, below: str, above: str) -> str:
    """``below`` when the interval lies under 0, ``above`` when over it, "–" when there is
    none (NaN bounds: no rows, one R, one seed), else unresolved."""
    if math.isnan(lo) or math.isnan(hi):
        return "–"
    if hi < 0:
        return below
    if lo > 0:
        return above
    return "not resolved"


def _simultaneous_bounds(per_r: pd.DataFrame) -> list[tuple[float, float]]:
    """Bounds of the paired log ratio at each R of one (map, D, std): t intervals
    Bonferroni-adjusted over the row's R, so that all of them hold together with at least 95%
    probability (7 separate 95% intervals call about one R in three rows "lower" or
    "higher" by chance when orthogonal and iid do not differ)."""
    tests = len(per_r)
    bounds = []
    for mean, sd, n in zip(
        per_r["log_ratio"], per_r["log_ratio_sd"], per_r["paired_seeds"], strict=True
    ):
        half = _t_quantile(int(n), tests) * sd / math.sqrt(n) if n > 1 else math.nan
        bounds.append((mean - half, mean + half))
    return bounds


def performer_verdict(frame: pd.DataFrame, metric: str = "attention_mse") -> pd.DataFrame:
    """Per (map, D, std): does the MSE fall with R (the per-seed log-log slopes' mean, iid
    and orthogonal), and at how many R is orthogonal below iid, above it, or neither, by
    the paired per-seed log ratio's t intervals, simultaneous (Bonferroni) over the R."""
    perf = frame[(frame["part"] == "performer") & (frame["metric"] == metric)]
    perf = perf[perf["method"] != "uniform"]
    table = performer_table(frame, metric)
    rows = []
    for (name, d, std), group in perf.groupby(["map", "head_dim", "std"]):
        row: dict = {"map": name, "D": d, "std": std}
        falls = []
        for label, orth in (("iid", False), ("orthogonal", True)):
            slope, lo, hi = _slope(group[(group["orthogonal"].astype(str) == "True") == orth])
            # no slope: this kind was not run (--only), or at one R, or with one seed
            row[f"slope, {label}"] = (
                "–" if math.isnan(slope) else f"{slope:.2f} [{lo:.2f}, {hi:.2f}]"
            )
            falls.append(_sign(lo, hi, "yes", "no (rises)"))
        row["MSE falls with R"] = (
            falls[0] if falls[0] == falls[1] else f"{falls[0]} (iid), {falls[1]} (orthogonal)"
        )
        per_r = table[(table["map"] == name) & (table["head_dim"] == d) & (table["std"] == std)]
        signs = [_sign(lo, hi, "lower", "higher") for lo, hi in _simultaneous_bounds(per_r)]
        labels = {"–": "undefined"}  # fewer than 2 paired seeds, or an MSE of 0 or inf
        counts = ", ".join(
            f"{signs.count(s)} {labels.get(s, s)}"
            for s in ("lower", "higher", "not resolved", "–")
            if signs.count(s)
        )
        row["orthogonal vs iid, per R"] = f"{counts} (of {len(signs)})" if signs else "–"
        ratios = np.exp(per_r["log_ratio"]).dropna()
        row["orth/iid range"] = f"{ratios.min():.3g}–{ratios.max():.3g}" if len(ratios) else "–"
        rows.append(row)
    return pd.DataFrame(rows)


def summarize(frame: pd.DataFrame, params: dict) -> str:
    parts = [
        "Queries and keys have iid N(0, std²) entries (D = head dim, N queries = N keys). "
        "In the R sweep, random maps run with their stabilizer off (it rescales φ, which "
        "would spoil the kernel MSE). Every row is a mean over seeds (new data and new "
        "features per seed)."
    ]
    if not (frame["part"] == "performer").any():
        parts.append(not_run_section("Performer: MSE vs number of random features R", "performer"))
    else:
        table = performer_table(frame)
        parts.append(
            "## The Performer finding (attention-matrix MSE)\n\n"
            "Slope: each seed's least-squares slope of log MSE on log R, averaged over "
            "seeds [95% t interval of that mean] (an unbiased kernel estimator's MSE "
            "falls as 1/R: slope −1). Orthogonal vs iid: at each R, the geometric mean over "
            "seeds of the paired ratio orth/iid (same data per seed); counted lower or "
            "higher where its t interval excludes 1, the intervals of a row's R taken "
            "together at 95% (Bonferroni over its R; the tables below show each R's own "
            "95% t interval, which exclude 1 by chance at about 1 R in 20); undefined at an R "
            "without two paired seeds of finite ratio (a kind not run there, one seed, an "
            "MSE of 0 or inf). This is the "
            "typical (geometric-mean) ratio, not the ratio of expected MSEs that the "
            "Performer's theorem bounds: the MSE is heavy-tailed, so means of a few seeds, "
            "shown below, can disagree with these.\n\n" + markdown_table(performer_verdict(frame))
        )
        if (frame[frame["part"] == "performer"]["metric"] == "kernel_mse").any():
            parts.append(
                "## The Performer finding on the kernel MSE, φ(q)·φ(k) vs exp(q·k/√D) (the "
                "quantity of the Performer's 1/R rate and orthogonal-vs-iid theorem), "
                "same tests\n\n" + markdown_table(performer_verdict(frame, "kernel_mse"))
            )
        show = table[["map", "head_dim", "std", "num_features", "iid", "orthogonal", "orth/iid"]]
        show = show.rename(columns={"head_dim": "D", "num_features": "R"})
        parts.append(
            "## Attention-matrix MSE vs number of random features R (mean ± sd over "
            f"{params['seeds']} seeds, N={params['seq_len']}; orth/iid: paired geometric "
            "mean [95% t interval])\n\n" + markdown_table(show)
        )
        ktable = performer_table(frame, "kernel_mse")
        if not ktable.empty:
            columns = ["iid", "orthogonal", "orth/iid", "ratio of means"]
            show = ktable[["map", "head_dim", "std", "num_features", *columns]]
            show = show.rename(columns={"head_dim": "D", "num_features": "R"})
            parts.append(
                "## Kernel MSE, φ(q)·φ(k) vs exp(q·k/√D) (ratio of means: mean orth MSE / "
                "mean iid MSE, the ratio of expected MSEs that the Performer's theorem bounds, "
                "[~95% interval from resampling the paired seeds])\n\n" + markdown_table(show)
            )
        parts.append(
            "## Uniform attention (1/N per key) baseline: smallest R that beats it\n\n"
            "Beats: paired by seed (shared data), the 95% t interval of the per-seed log "
            "ratio of MSEs map/uniform below 0 (the typical ratio, as above); one seed is "
            "decided by sign, and says so; > R: at none of the R run.\n\n"
            + markdown_table(smallest_r_beating_uniform(table))
        )
    if not (frame["part"] == "maps").any():
        parts.append(not_run_section("Every registered map at a matched F", "maps"))
    else:
        maps = frame[frame["part"] == "maps"]
        counts = maps.groupby(["std", "method", "stage", "map"], dropna=False)["seed"].nunique()
        configured = params.get("map_seeds")
        lo, hi = counts.min(), counts.max()
        seeds = f"{lo} seed(s)" if lo == hi else f"{lo}–{hi} seed(s)"
        if configured is not None and not (counts == configured).all():
            seeds += f" (of {configured} configured: a partial run)"
        extra = params.get("extra_maps") or []  # their labels name their hyperparameters
        parts.append(
            "## Every registered map"
            + (f" and {len(extra)} configured map(s) of extra_maps" if extra else "")
            + f" at F = {params['map_feature_dim']} where its size can "
            "be set (maps whose F follows from D keep their own: F column) (held-out data; "
            f"learned maps before/after {params['fit_steps']} steps of fit_to_softmax on "
            f"{params['fit_batch']} other sequences; means over {seeds}; – where a seed's "
            "value is undefined: a signed map's KL where a row has a negative weight)\n\n"
            "Fitted: on the distillation loss plus the map's own penalty, as the map trains "
            "(softplus_ffn, oglu and aoglu: reg_weight·‖WᵀW − I‖², Yorsh & Kovalenko's "
            f"orthogonality term, reg_weight 0.01 by default). {UNPENALIZED.capitalize()}: those "
            "maps from the same init and seed on the distillation loss alone, which is what "
            "they can represent; the difference between the two rows is the penalty's cost to "
            "the approximation.\n\n"
            "Beats uniform (KL): paired by seed (shared data), yes/no where the 95% t interval "
            "of the per-seed log ratio of KLs map/uniform excludes 0; a row of one seed, or "
            "with a KL of 0 or inf, is decided by the sign of the difference, and says so.\n\n"
            + markdown_table(maps_table(frame))
        )
    return "\n\n".join(parts)


#: What each performer figure plots (its title's first line).
PERFORMER_TITLES = {
    "kernel_mse": "Kernel MSE of φ(q)·φ(k) against exp(q·k/√D) by number of random features R",
    "attention_mse": "Attention-matrix MSE against softmax by number of random features R",
}


def _sizes(rows: pd.DataFrame, column: str) -> str:
    """The values of ``column`` in ``rows``, e.g. ``"64"`` or ``"64, 100"`` (whole numbers
    without the ``.0`` of a column read as float beside NaN)."""
    values = sorted(rows[column].dropna().unique())
    return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def figures(frame: pd.DataFrame, params: dict) -> dict:
    figs = {}
    perf = frame[frame["part"] == "performer"].copy()
    if not perf.empty:
        perf["features"] = perf["orthogonal"].map(
            lambda o: "orthogonal" if str(o) == "True" else "iid"
        )
        perf["setting"] = perf.apply(lambda r: f"{r['map']} D={r.head_dim}", axis=1)
        for metric in PERFORMER_METRICS:
            # errors spanning decades on a log axis: the geometric mean ×/÷ geometric sd (an
            # arithmetic sd reached below 0 in a quarter of the points, and one seed's tail
            # set a mean 1000x its median)
            values = perf.loc[perf["metric"] == metric, "value"]
            finite = values[np.isfinite(values)]
            geometric = bool((finite > 0).all())
            fig = ks.analysis.plots.plot_approximation(
                perf,
                metric=metric,
                x="num_features",
                hue="features",
                col="std",
                row="setting",
                estimator="geometric" if geometric else "mean",
            )
            spread = "geometric mean ×/÷ 1 geometric sd" if geometric else "mean ± 1 sd"
            ks.analysis.plots.figure_title(
                fig,
                f"{PERFORMER_TITLES[metric]}\niid vs orthogonal features: {spread} over "
                f"{perf['seed'].nunique()} seeds; N = {_sizes(perf, 'n')}, q and k entries "
                "iid N(0, std²)",
            )
            figs[f"performer_{metric}"] = fig
    maps = frame[frame["part"] == "maps"].copy()
    if not maps.empty:
        kl = maps["metric"] == "attention_kl"
        # no bar where a seed's KL is undefined (as the table's –): the mean of the others
        # would be of the seeds whose data happened to give no negative weight
        groups = maps[kl].groupby(["std", "method", "stage"], dropna=False)["value"]
        partial = groups.transform(lambda v: v.isna().any()).astype(bool)
        maps.loc[partial[partial].index, "value"] = math.nan
        undefined = sorted(  # signed features: rows that are no distributions, no KL
            m for m, values in maps[kl].groupby("method")["value"] if values.isna().any()
        )
        left_out = (
            f" (no KL for {', '.join(undefined)} where a seed's rows had negative weights)"
            if undefined
            else ""
        )
        fig = ks.analysis.plots.plot_map_comparison(maps, metric="attention_kl", col="std")
        ks.analysis.plots.figure_title(
            fig,
            "Attention KL(softmax row ‖ map row) of every map at F = "
            f"{_sizes(maps, 'target_feature_dim')} where its size can be set{left_out}\n"
            f"mean ± 1 sd over {maps['seed'].nunique()} seeds of held-out q, k (entries iid "
            f"N(0, std²), N = {_sizes(maps, 'n')}, D = {_sizes(maps, 'head_dim')}); learned "
            "maps at init and after fitting (with their own penalty, and without it)",
        )
        figs["maps_attention_kl"] = fig
    return figs


if __name__ == "__main__":
    raise SystemExit(main("approximation"))
