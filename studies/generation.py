"""Autoregressive generation throughput and memory: linear attention in RNN mode vs softmax
without a KV cache (the paper's baseline) vs softmax with a KV cache (the fair baseline)."""

from __future__ import annotations

import pandas as pd
import torch

import kernelstudy as ks
from kernelstudy.study import (
    check_lengths,
    check_map_builds,
    check_params,
    main,
    map_label,
    markdown_table,
    parse_map_label,
)

RUNS = {
    "linear, RNN state": ("kernel", "step"),
    "softmax, no cache": ("softmax", "full"),
    "softmax, KV cache": ("softmax", "step"),
}


#: The kinds of the config's plain entries (:func:`kernelstudy.study.check_params`).
PARAMS = {
    "n_layers": "count",
    "d_model": "count",
    "n_heads": "count",
    "vocab_size": "count",
    "batch": "count",
    "prompt_len": "count",
    "repeats": "count",
    "time_limit_s": "positive",
}


def configs(params: dict) -> list[dict]:
    """One config per way of generating; all lengths inside (longer ones skipped once slow)."""
    check_params(params, PARAMS)
    keys = ("n_layers", "d_model", "n_heads", "vocab_size", "feature_map", "batch", "prompt_len")
    # a mistyped map failed only once the linear run started (never under --only run=softmax…);
    # a name stays as it is (the committed rows' ids), a table becomes its label, e.g.
    # "favor(num_features=64, orthogonal=False)": CSV column, --only and id alike
    values = {**params, "feature_map": map_label(params["feature_map"], "feature_map")}
    d_model, n_heads = params["d_model"], params["n_heads"]  # positive ints (check_params)
    if d_model % n_heads == 0:  # else the model names the bad sizes when it is built
        check_map_builds(  # as each layer of the linear run builds it, before any runs
            "feature_map",
            lambda: ks.create_feature_map(
                parse_map_label(values["feature_map"]),
                head_dim=d_model // n_heads,
                num_heads=n_heads,
            ),
        )
    # the time-limit skip assumes ascending lengths (a slow one skips all after it)
    check_lengths("lengths", params["lengths"])
    return [
        {
            "run": label,
            **{k: values[k] for k in keys},
            "lengths": params["lengths"],
            "repeats": params["repeats"],
            "time_limit_s": params["time_limit_s"],
        }
        for label in RUNS
    ]


def run_config(config: dict, device: str) -> pd.DataFrame:
    attention, mode = RUNS[config["run"]]
    torch.manual_seed(0)
    model = ks.nn.CausalLM(
        config["vocab_size"],
        d_model=config["d_model"],
        n_heads=config["n_heads"],
        n_layers=config["n_layers"],
        dropout=0.0,
        attention=attention,
        feature_map=parse_map_label(config["feature_map"]) if attention == "kernel" else None,
        positions="sinusoidal",
    ).eval()
    frame = ks.analysis.benchmark_generation(
        {config["run"]: (model, mode)},
        config["lengths"],
        batch=config["batch"],
        prompt_len=config["prompt_len"],
        device=device,
        repeats=config["repeats"],
        time_limit_s=config["time_limit_s"],
        vocab_size=config["vocab_size"],
    )
    return frame.drop(columns=["label"])  # the config's "run" column names it


def summary_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per length: tokens/s of each run, both speed-ups of RNN mode, state sizes. Columns that
    need a run with no rows (e.g. left out by ``--only``) are left out."""
    tps = frame[frame["metric"] == "tokens_per_s"].pivot_table(
        index="length", columns="run", values="value", aggfunc="mean"
    )
    state = frame[frame["metric"] == "state_mb"].pivot_table(
        index="length", columns="run", values="value", aggfunc="mean"
    )
    table = pd.DataFrame(index=tps.index)
    for label in RUNS:
        if label in tps:
            table[f"{label} (tok/s)"] = tps[label]
    rnn = "linear, RNN state"
    for base, name in (("softmax, no cache", "no cache"), ("softmax, KV cache", "KV cache")):
        if rnn in tps and base in tps:
            table[f"speed-up vs {name}"] = tps[rnn] / tps[base]
    for label, name in ((rnn, "RNN state (MiB)"), ("softmax, KV cache", "KV cache (MiB)")):
        if label in state:
            table[name] = state[label]
    return table.reset_index()


def superquadratic_growth(frame: pd.DataFrame, run: str = "softmax, KV cache") -> list[str]:
    """Steps between consecutive lengths L1 < L2 where ``run``'s generation time grew by more
    than (L2/L1)², the most its O(L²) work allows: time spent on something else than the
    attention's arithmetic (for the KV cache: memory traffic, its reads of a cache that
    outgrows the processor's caches, and the copies when its buffer doubles),
    "L1→L2: x.x× (≤ y× for O(L²))"."""
    times = frame[(frame["run"] == run) & (frame["metric"] == "time_s")]
    times = times.groupby("length")["value"].median().dropna().sort_index()
    out = []
    for (l1, t1), (l2, t2) in zip(times.items(), list(times.items())[1:], strict=False):
        if t2 / t1 > (l2 / l1) ** 2:
            out.append(f"{l1}→{l2}: {t2 / t1:.1f}× (≤ {(l2 / l1) ** 2:.0f}× for O(L²))")
    return out


def summarize(frame: pd.DataFrame, params: dict) -> str:
    missing = ", ".join(f"run={label!r}" for label in RUNS if label not in set(frame["run"]))
    note = f"\n\nNot run yet (no rows; their columns are left out): {missing}" if missing else ""
    grown = superquadratic_growth(frame)
    if grown:
        note += (
            "\n\nThe KV cache's generation time grew faster than its O(length²) work allows at "
            + "; ".join(grown)
            + ". Something besides attention's arithmetic sets it there: memory traffic (each "
            "step reads the whole cache, which outgrows the processor's caches as it grows, and "
            "the cache's buffer is copied when it doubles, amortized O(1) per step). The "
            "speed-up against it at those lengths is not attention's arithmetic alone."
        )
    return (
        f"Model: {params['n_layers']} layers, d_model={params['d_model']}, {params['n_heads']} "
        f"heads, vocab {params['vocab_size']}, map {map_label(params['feature_map'])}; batch "
        f"{params['batch']}, greedy decoding, throughput = batch·length/time. '–' = skipped "
        "(a shorter length already took longer than time_limit_s). Each throughput is from the "
        f"median time of {params['repeats']} generations in one invocation; the runs of a length "
        "may come "
        "from separate invocations (the 'Written' lines below), so a speed-up near 1 also "
        "holds the machine's drift between them.\n\n" + markdown_table(summary_table(frame)) + note
    )


#: What each generation figure plots (its axes' title; the figure's names the linear map).
WHAT = {
    "tokens_per_s": "Greedy decoding throughput (new tokens/s)",
    "state_mb": "RNN state or KV cache size at the end",
}


def figures(frame: pd.DataFrame, params: dict) -> dict:
    title = f"feature map of the linear run: {map_label(params['feature_map'])}"
    rows = frame.dropna(subset=["value"])
    runs = list(dict.fromkeys(frame["run"].astype(str)))  # one colour per run in every figure
    figs = {}
    for metric in ("tokens_per_s", "state_mb"):
        sub = rows[rows["metric"] == metric]
        if not sub.empty:
            fig = ks.analysis.plots.line_plot(
                sub,
                "length",
                hue="run",
                hue_order=runs,
                errorbar=None,
                ylabel=ks.analysis.plots.metric_label(metric),
                title=title,
            )
            fig.axes[0].set_title(
                f"{WHAT[metric]}\nbatch {params['batch']}; {params['n_layers']} layers, "
                f"d_model {params['d_model']}, {params['n_heads']} heads",
                fontsize="medium",
            )
            figs[f"generation_{metric}"] = fig
    return figs


if __name__ == "__main__":
    raise SystemExit(main("generation"))
