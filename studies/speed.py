"""Speed and memory of one attention layer vs sequence length: softmax (SDPA and explicit N×N)
against linear attention on every core backend, forward and forward+backward, with the
machine's measured matmul rate; the "Transformers are RNNs" artificial benchmark and the
Performer poster's setting (one head, R=100 FAVOR+ features, d=50)."""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd

import kernelstudy as ks
from kernelstudy.study import (
    check_lengths,
    check_map_builds,
    check_params,
    main,
    map_label,
    markdown_table,
    matched_map,
    parse_map_label,
)

SETTINGS = ("rnn_benchmark", "performer")


#: The kinds of the config's plain entries (:func:`kernelstudy.study.check_params`).
PARAMS = {
    "repeats": "count",
    "warmup": "count0",
    "time_limit_s": "positive",
    "max_quadratic_gb": "positive",
    **{
        f"{setting}.{key}": kind
        for setting in SETTINGS
        for key, kind in {
            "batch": "count",
            "heads": "count",
            "head_dim": "count",
            "methods": ks.analysis.speed.METHODS,
            "causal": "flags",
            "passes": ks.analysis.speed.PASSES,
        }.items()
    },
}


def configs(params: dict) -> list[dict]:
    """One config per (setting, method, causal, pass); all N inside (longer N skipped once slow)."""
    check_params(params, PARAMS)
    # the time-limit skip assumes ascending N (a slow N skips all after it)
    for key in ("seq_lens", "seq_lens_cuda"):
        check_lengths(key, params[key])
    out = []
    for setting in SETTINGS:
        s = params[setting]
        # a name as it is (the committed rows' ids), a table as its label, e.g.
        # "favor(num_features=64, orthogonal=False)": CSV column, --only and id alike
        label = map_label(s["feature_map"], f"{setting}.feature_map")
        num_features = _num_features(setting, s, parse_map_label(label))
        check_map_builds(  # what each run builds, before any runs
            f"{setting}.feature_map",
            functools.partial(
                _build,
                {"feature_map": label, "num_features": num_features, "head_dim": s["head_dim"]},
                s["heads"],
            ),
        )
        for method in s["methods"]:
            for causal in s["causal"]:
                for pass_ in s["passes"]:
                    out.append(
                        {
                            "setting": setting,
                            "method": method,
                            "causal": causal,
                            "pass": pass_,
                            "batch": s["batch"],
                            "heads": s["heads"],
                            "head_dim": s["head_dim"],
                            "feature_map": label,
                            "num_features": num_features,
                            "seq_lens": params["seq_lens"],
                            "seq_lens_cuda": params["seq_lens_cuda"],
                            "repeats": params["repeats"],
                            "warmup": params["warmup"],
                            "time_limit_s": params["time_limit_s"],
                            "max_quadratic_gb": params["max_quadratic_gb"],
                        }
                    )
    return out


def _num_features(setting: str, s: dict, spec: str | dict) -> int:
    """The setting's ``num_features``: the feature dimension F its map is matched to (through
    the map's size hyperparameter, ``matched_feature_map``); 0 or absent: the map's own. It is
    refused for a map without a size hyperparameter, and beside a feature-map table that
    sets that hyperparameter itself."""
    value = s.get("num_features", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{setting}.num_features must be an int >= 0 (the feature dimension F the map is "
            f"matched to; 0 or absent: the map's own), got {value!r}"
        )
    if not value:
        return value
    name = spec if isinstance(spec, str) else spec["name"]
    knob = ks.analysis.matching.size_knob(ks.feature_maps.get_feature_map_class(name))
    if knob is None:  # the summary would show an R the map does not have
        raise ValueError(
            f"{setting}: num_features = {value}, but feature map {name!r} has no size "
            "hyperparameter (its F is its own): leave num_features out or at 0"
        )
    if isinstance(spec, dict) and knob in spec:
        raise ValueError(
            f"{setting}: num_features = {value} and feature_map's {knob} = {spec[knob]} "
            f"both set the map's size; give one (num_features = 0 in [{setting}], or "
            f"no {knob} in its feature_map table)"
        )
    return value


def feature_map(config: dict) -> str | dict | ks.FeatureMap:
    """The map of a config's linear attention: its ``feature_map`` label as the name or
    config dict it stands for, matched to F = ``num_features`` when that is set (the table's
    other hyperparameters kept)."""
    if not config["num_features"]:
        return parse_map_label(config["feature_map"])
    return matched_map(config["feature_map"], config["head_dim"], config["num_features"])


def _build(config: dict, heads: int) -> ks.FeatureMap:
    """The FeatureMap of :func:`feature_map` (a name or dict built for ``heads`` heads, as
    ``benchmark_attention`` builds it)."""
    fm = feature_map(config)
    if isinstance(fm, ks.FeatureMap):
        return fm
    return ks.create_feature_map(fm, head_dim=config["head_dim"], num_heads=heads)


def run_config(config: dict, device: str) -> pd.DataFrame:
    fm = feature_map(config)
    return ks.analysis.benchmark_attention(
        config["seq_lens_cuda"] if device == "cuda" else config["seq_lens"],
        head_dim=config["head_dim"],
        batch=config["batch"],
        heads=config["heads"],
        feature_map=fm,
        methods=[config["method"]],
        causal=[config["causal"]],
        passes=[config["pass"]],
        device=device,
        repeats=config["repeats"],
        warmup=config["warmup"],
        time_limit_s=config["time_limit_s"],
        max_quadratic_gb=config["max_quadratic_gb"],
    )  # its method/causal/pass equal the config's, but for the matmul yardstick's row


def _table(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    rows = frame[(frame["metric"] == metric) & (frame["n"] > 0)].copy()
    rows["label"] = ks.analysis.speed_labels(rows)
    rows["causal"] = rows["causal"].map(lambda c: "causal" if str(c) == "True" else "non-causal")
    table = rows.groupby(["causal", "pass", "label", "n"])["value"].first().unstack("n")
    table.columns = [f"N={n}" for n in table.columns]
    return table.reset_index()


def exponent_table(frame: pd.DataFrame, metric: str = "time_ms", points: int = 3) -> pd.DataFrame:
    """The claim is about growth with N (O(N) vs O(N²)), which no single N shows: per
    (causal, pass, method), the least-squares slope k of log ``metric`` on log N over the
    ``points`` largest N it was measured at (metric ∝ N^k there; fixed costs dominate small
    N), with that N range. NaN where fewer than 2 N were measured."""
    rows = frame[(frame["metric"] == metric) & (frame["n"] > 0)].dropna(subset=["value"])
    rows = rows.assign(label=ks.analysis.speed_labels(rows))
    rows["causal"] = rows["causal"].map(lambda c: "causal" if str(c) == "True" else "non-causal")
    out = []
    for (causal, pass_, label), g in rows.groupby(["causal", "pass", "label"]):
        g = g.groupby("n")["value"].median().sort_index().iloc[-points:]
        k = np.polyfit(np.log(g.index), np.log(g.to_numpy()), 1)[0] if len(g) > 1 else np.nan
        n_range = f"{int(g.index[0])}–{int(g.index[-1])}" if len(g) else "–"
        out.append({"causal": causal, "pass": pass_, "label": label, "N": n_range, "k": k})
    return pd.DataFrame(out)


def _setting_text(setting: str, s: dict) -> str:
    """``B=1, H=1, D=50, map=favor (R=100)``: a setting's sizes and map (its label)."""
    return (
        f"B={s['batch']}, H={s['heads']}, D={s['head_dim']}, "
        f"map={map_label(s['feature_map'], f'{setting}.feature_map')}"
        + (f" (R={s['num_features']})" if s.get("num_features") else "")
    )


#: Said under the growth table: the reference backend is linear attention's formula computed
#: through the explicit N×N kernel matrix (the tests' ground truth), quadratic by design.
REFERENCE_NOTE = (
    ". linear [reference] computes linear attention through the explicit N×N kernel matrix "
    "(the ground truth the tests compare against): quadratic by design, not a linear path"
)


def summarize(frame: pd.DataFrame, params: dict) -> str:
    parts = []
    for setting in SETTINGS:
        sub = frame[frame["setting"] == setting]
        if sub.empty:
            continue
        s = params[setting]
        rate = sub[sub["metric"] == "gflops"]["value"]
        head = (
            f"## {setting}: {_setting_text(setting, s)}; matmul rate measured in this run: "
            f"{rate.median():.0f} GFLOP/s"
        )
        parts.append(
            head
            + "\n\nMedian time (ms); '–' = skipped (too slow or too much memory)\n\n"
            + markdown_table(_table(sub, "time_ms"))
        )
        parts.append(
            "Peak memory above the inputs (MiB)\n\n" + markdown_table(_table(sub, "peak_memory_mb"))
        )
        time_k = exponent_table(sub, "time_ms").rename(columns={"k": "time ∝ N^k"})
        memory_k = exponent_table(sub, "peak_memory_mb")[["causal", "pass", "label", "k"]]
        both = time_k.merge(memory_k.rename(columns={"k": "memory ∝ N^k"}), how="left")
        parts.append(
            "Growth with N: slope k of log time (and of log memory) on log N over the 3 "
            "largest N each method ran at (N column); O(N) is k = 1, O(N²) is k = 2"
            + (REFERENCE_NOTE if "backend" in sub and (sub["backend"] == "reference").any() else "")
            + "\n\n"
            + markdown_table(both, floatfmt=".2f")
        )
    return "\n\n".join(parts)


def figures(frame: pd.DataFrame, params: dict) -> dict:
    figs = {}
    for setting in SETTINGS:
        sub = frame[(frame["setting"] == setting) & (frame["n"] > 0)]
        if sub.empty:
            continue
        sub = sub.assign(label=ks.analysis.speed_labels(sub))
        for metric, stem in (("time_ms", "time"), ("peak_memory_mb", "memory")):
            fig = ks.analysis.plots.plot_speed(sub, metric=metric)
            ks.analysis.plots.figure_title(
                fig, f"{setting}: {_setting_text(setting, params[setting])}"
            )
            figs[f"{setting}_{stem}"] = fig
    return figs


if __name__ == "__main__":
    raise SystemExit(main("speed"))
