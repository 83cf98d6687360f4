"""Attention rank: softmax attention is (numerically) full rank, kernel attention with F
features has rank <= F. Numerical rank (at a stated tolerance), effective rank and stable rank
as N and F grow, on Gaussian and on captured queries/keys; plus the copy experiment.

Besides ``results.csv`` the study writes ``spectra.csv`` (the extra table ``spectra``): the
normalized singular-value spectrum of every attention matrix whose rank it measures, one row
per singular value, with columns

- ``config_id``: the run (join with ``results.csv`` for its full config and device);
- ``part`` (``gaussian`` or ``copy``), ``method`` (the map, or the trained model in the copy
  part), ``feature_dim`` (F; 0 for softmax), ``n`` (N, the matrix size), ``seed``;
- ``captured_with``: copy part only, the attention applied to the model's captured q/k
  (empty for the Gaussian part);
- ``i``: 1-based index, ``sigma_ratio``: σ_i / σ_1 (6 significant digits; the first is 1).

Every matrix is one head (batch 0, head 0; the copy models have one layer and one head).
Spectra for results computed before the table existed: ``--fill-tables`` reruns those
configurations (it reports any whose results it does not reproduce) and keeps ``results.csv``;
add ``--only part=gaussian`` to skip retraining the copy models. On one CPU thread the full
size takes about 1 min for the Gaussian part and 1 min per copy model (12 models).
"""

from __future__ import annotations

import pandas as pd
import torch

import kernelstudy as ks
from kernelstudy.arguments import check_count
from kernelstudy.study import (
    check_lengths,
    check_map_builds,
    check_map_list,
    check_names,
    check_params,
    main,
    markdown_table,
    matched_map,
    not_run_section,
)
from kernelstudy.tasks import CopyTask
from kernelstudy.train.trainer import TrainConfig, Trainer

MEASURES = ("numerical_rank", "effective_rank", "stable_rank")
TABLES = ("spectra",)  # spectra.csv beside results.csv


#: Hyperparameters a map table of this study may not set: the study sets them.
STUDY_SETS = {"seed": "the study draws each seed's own features (and copy model)"}


def extra_maps(params: dict) -> list[str]:
    """The labels of ``extra_maps`` (absent: none): maps the Gaussian part measures beside
    the registered ones, as tables of a name and hyperparameters (e.g.
    ``"glu(depth=2)"``) or ``"module:Class"`` names. Each is matched to every F of the sweep
    through its size hyperparameter, as the registered maps are, so a table that sets that
    (or ``seed``) is refused, as is a registered map by its name alone (the part has it,
    unless ``exclude_maps`` names it) and one map twice."""
    return check_map_list(
        "extra_maps",
        params.get("extra_maps", []),
        study_sets=STUDY_SETS,
        size="the Gaussian part matches every map to each F of its sweep through it",
        registered="the Gaussian part has unless exclude_maps names it (take it out of "
        "exclude_maps to add it); extra_maps adds tables with hyperparameters and "
        "'module:Class' maps",
    )


#: The kinds of the config's plain entries (:func:`kernelstudy.study.check_params`).
PARAMS = {
    "head_dim": "count",
    "std": "positive",
    "feature_dims": "counts",
    "fixed_n": "count",
    "copy.copy_len": "count",
    "copy.n_symbols": "count",
    "copy.d_model": "count",
    "copy.d_ff": "count",
    "copy.feature_dim": "count",
    "copy.batch_size": "count",
    "copy.lr": "positive",
    "copy.train_samples": "count",
    "copy.val_samples": "count",
    "copy.steps": "count",
    "copy.eval_every": "count",
}


def configs(params: dict) -> list[dict]:
    """Gaussian part: one config per (method, F, N, seed): the N sweep at F = D and the F sweep
    at N = fixed_n. Methods: softmax (N sweep only), every registered map not in
    ``exclude_maps`` and every map of ``extra_maps`` (a map whose F is fixed, such as elu with
    F = D, enters at its own F only). A map given by name is its name in ``method`` (the
    committed rows' ids); a table is its label, e.g. ``"glu(depth=2)"``."""
    check_params(params, PARAMS)
    d = params["head_dim"]
    check_lengths("seq_lens", params["seq_lens"])  # a 0 or a duplicate is a mistyped sweep
    points = [(d, n) for n in params["seq_lens"]]
    points += [(f, params["fixed_n"]) for f in params["feature_dims"]]
    todo = [("softmax", 0, n) for n in params["seq_lens"]]
    excluded = check_names("exclude_maps", params["exclude_maps"], ks.list_feature_maps())
    registered = [m for m in ks.list_feature_maps() if m not in excluded]
    extra = extra_maps(params)
    for name in registered + extra:
        for target, n in points:
            if name in extra:  # built as its runs build it, before any run (a bad one named)
                key = f"extra_maps[{extra.index(name)}]"
                fm = check_map_builds(key, lambda name=name, t=target: matched_map(name, d, t))
            else:
                fm = ks.analysis.matched_feature_map(name, d, target)
            todo.append((name, fm.feature_dim, n))
    out = _copy_configs(params)
    seeds = check_count("seeds", params["seeds"], 1)  # 0 left the part out without a word
    for method, f, n in sorted(set(todo)):
        for seed in range(seeds):
            out.append(
                {
                    "part": "gaussian",
                    "method": method,
                    "feature_dim": f,
                    "n": n,
                    "seed": seed,
                    "head_dim": d,
                    "std": params["std"],
                }
            )
    return out


def run_config(config: dict, device: str) -> dict[str, list[dict]]:
    """Rows of ``results.csv`` (rank measures, or the copy part's curves and ranks) and of
    ``spectra.csv`` (the normalized spectrum of each matrix measured)."""
    if config["part"] == "copy":
        return _run_copy(config, device)
    d, n, seed = config["head_dim"], config["n"], config["seed"]
    q, k = ks.analysis.gaussian_qk(n, d, config["std"], seed=10_000 + seed, device=device)
    feature_map = config["method"]
    if feature_map != "softmax":
        feature_map = matched_map(feature_map, d, config["feature_dim"], seed).to(device)
    A = ks.analysis.attention_matrix(q.double(), k.double(), feature_map)[0, 0]
    ranks = ks.analysis.attention_rank(A)
    rows = [{"metric": m, "value": float(ranks[m])} for m in MEASURES]
    run = {k: config[k] for k in ("part", "method", "feature_dim", "n", "seed")}
    return {
        "results": [*rows, {"metric": "tol", "value": ranks["tol"]}],
        "spectra": spectrum_rows(ranks["singular_values"], **run),
    }


def spectrum_rows(
    singular_values, part: str, method: str, feature_dim: int, n: int, seed: int, captured_with=None
) -> list[dict]:
    """Rows of ``spectra.csv`` for one matrix: its run's columns, ``i`` (1-based) and
    ``sigma_ratio`` = σ_i / σ_1."""
    run = {"part": part, "method": method, "feature_dim": int(feature_dim), "n": int(n)}
    run |= {"seed": int(seed), "captured_with": captured_with}
    ratios = ks.analysis.normalized_spectrum(singular_values)
    return [{**run, "i": i + 1, "sigma_ratio": float(r)} for i, r in enumerate(ratios)]


# --- the copy experiment: "do we need full rank?" ---------------------------------------------


def copy_models(params: dict) -> list[str]:
    """The labels of ``copy.models``: ``"softmax"`` and feature maps by name or as tables of a
    name and hyperparameters (matched to F = ``copy.feature_dim`` through their size
    hyperparameter, so a table may not set that, nor ``seed``), each built before any run."""
    c = params["copy"]
    labels = check_map_list(
        "copy.models",
        c["models"],
        study_sets=STUDY_SETS,
        size="the copy part matches every map to F = copy.feature_dim through it",
        plain=("softmax",),
    )
    for i, label in enumerate(labels):
        if label != "softmax":
            check_map_builds(
                f"copy.models[{i}]",
                lambda label=label: matched_map(label, c["d_model"], c["feature_dim"]),
            )
    return labels


def _copy_configs(params: dict) -> list[dict]:
    """One config per (model, seed); the softmax model's names the maps its captured q/k
    leave out (``exclude_maps``)."""
    c = params["copy"]
    excluded = check_names("exclude_maps", params["exclude_maps"], ks.list_feature_maps())
    return [
        {
            "part": "copy",
            "method": name,
            "seed": seed,
            **{k: v for k, v in c.items() if k not in ("models", "seeds")},
            **({"exclude_maps": sorted(excluded)} if name == "softmax" else {}),
        }
        for name in copy_models(params)
        for seed in range(check_count("copy.seeds", c["seeds"], 1))
    ]


def _copy_model(config: dict, vocab_size: int, max_len: int) -> ks.nn.CausalLM:
    feature_map = None
    if config["method"] != "softmax":
        feature_map = matched_map(
            config["method"], config["d_model"], config["feature_dim"], config["seed"]
        ).config()
    return ks.nn.CausalLM(
        vocab_size,
        d_model=config["d_model"],
        n_heads=1,
        n_layers=1,
        d_ff=config["d_ff"],
        dropout=0.0,
        attention="softmax" if feature_map is None else "kernel",
        feature_map=feature_map,
        positions="sinusoidal",
        max_len=max_len,
    )


def _run_copy(config: dict, device: str) -> dict[str, list[dict]]:
    """Train one model on the copy task; results: validation curves, then attention ranks;
    spectra: those of the attention matrices whose ranks are measured."""
    seq_len = 2 * config["copy_len"] + 2
    task = {"seq_len": seq_len, "n_symbols": config["n_symbols"], "seed": config["seed"]}
    task |= {"min_copy": config["copy_len"], "max_copy": config["copy_len"]}
    train = CopyTask("train", num_samples=config["train_samples"], **task)
    val = CopyTask("val", num_samples=config["val_samples"], **task)
    torch.manual_seed(config["seed"])
    model = _copy_model(config, train.vocab_size, seq_len)
    train_config = TrainConfig(
        steps=config["steps"],
        batch_size=config["batch_size"],
        lr=config["lr"],
        warmup_steps=config["steps"] // 10,
        schedule="cosine",
        eval_every=config["eval_every"],
        seed=config["seed"],
        device=device,
        progress=False,
    )
    trainer = Trainer(model, train, train_config, val_data=val)
    # the model holds the weights of its best validation step (restore_best), not the last
    # step's: the rank rows name that step, so the tables pair them with its accuracy
    model_step = trainer.fit()["model_step"]
    f = model.feature_dim or 0
    rows = []
    for _, row in trainer.metrics.iterrows():
        for metric in ("val_accuracy", "val_sequence_accuracy", "val_loss"):
            rows.append(
                {"step": int(row["step"]), "feature_dim": f, "metric": metric, "value": row[metric]}
            )
    ids = val[0]["input_ids"][None].to(trainer.device)
    ranks, spectra = _captured_ranks(model.eval(), ids, config, f)
    ranks = [{**row, "step": model_step} for row in ranks]
    return {"results": rows + ranks, "spectra": spectra}


def _captured_maps(exclude_maps: list[str]) -> list[str]:
    """The maps the softmax copy model's q/k run through: every registered one not in
    ``exclude_maps`` (as in the Gaussian part; the shipped config leaves out the
    non-positive ``identity``, whose rows are not distributions)."""
    return [name for name in ks.list_feature_maps() if name not in exclude_maps]


def _captured_ranks(
    model: ks.nn.CausalLM, ids: torch.Tensor, config: dict, f: int
) -> tuple[list[dict], list[dict]]:
    """Ranks (and spectra rows) of the non-causal attention matrices built from the trained
    model's own q/k (one validation sequence): with its own attention, and — for the softmax
    model — with every registered map not in its ``exclude_maps`` at F = feature_dim
    applied to the captured q/k."""
    (q, k), *_ = ks.analysis.capture_qk(model, ids).values()
    q, k = q.double(), k.double()
    if config["method"] == "softmax":
        maps = {"softmax": "softmax"}
        for name in _captured_maps(config["exclude_maps"]):
            maps[name] = ks.analysis.matched_feature_map(
                name, q.shape[-1], config["feature_dim"], seed=config["seed"]
            )
    else:
        maps = {config["method"]: model.encoder.layers[0].attn.feature_map}
    rows, spectra = [], []
    for name, fm in maps.items():
        A = ks.analysis.attention_matrix(q, k, fm)[0, 0]
        ranks = ks.analysis.attention_rank(A)
        dim = 0 if name == "softmax" else fm.feature_dim
        for m in MEASURES:
            rows.append(
                {"captured_with": name, "feature_dim": dim, "metric": m, "value": float(ranks[m])}
            )
        spectra += spectrum_rows(
            ranks["singular_values"],
            "copy",
            config["method"],
            dim,
            A.shape[-1],
            config["seed"],
            name,
        )
    return rows, spectra


def copy_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Validation accuracy of each model at a few steps (mean over seeds), and each seed's
    accuracy at the last step: with a few seeds the spread, not the mean, says whether two
    maps differ (e.g. one seed near chance, another near 100 %)."""
    rows = frame[(frame["part"] == "copy") & (frame["metric"] == "val_accuracy")]
    table = rows.pivot_table(index="method", columns="step", values="value", aggfunc="mean")
    steps = list(table.columns)
    keep = sorted({steps[len(steps) * i // 4] for i in range(1, 4)} | {steps[-1]})
    table = table[keep]
    table.columns = [f"step {int(s)}" for s in keep]
    last = rows[rows["step"] == steps[-1]].groupby(["method", "seed"])["value"].mean()
    table[f"step {int(steps[-1])}, per seed"] = [
        ", ".join(f"{v:.2f}" for v in last[m].sort_values()) if m in last.index else "–"
        for m in table.index
    ]
    return table.reset_index()


def captured_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds of each rank measure on the trained copy models' captured q/k, per
    (trained model, attention, F), beside the validation accuracy of the weights measured
    (each run's best validation step, which the trainer restores: mean over seeds) and those
    steps (sorted; "–" for rows written before the step was recorded)."""
    copy = frame[frame["part"] == "copy"]
    rows = copy[copy["metric"].isin(MEASURES)].copy()
    rows["trained model"] = rows["method"]
    table = rows.pivot_table(
        index=["trained model", "captured_with", "feature_dim"],
        columns="metric",
        values="value",
        aggfunc="mean",
    )
    # each run's measured step, and its validation accuracy from the run's curve
    measured = rows.groupby(["method", "seed"])["step"].first().dropna()
    curve = copy[copy["metric"] == "val_accuracy"].groupby(["method", "seed", "step"])["value"]
    accuracy = curve.mean()
    by_model = pd.DataFrame(
        {
            "method": [method for method, _ in measured.index],
            "step": measured.to_numpy(),
            "accuracy": [
                accuracy.get((*run, step), float("nan")) for run, step in measured.items()
            ],
        }
    )
    table = table.reset_index()
    models = table["trained model"]
    table["val accuracy"] = models.map(by_model.groupby("method")["accuracy"].mean())
    steps = by_model.groupby("method")["step"].agg(
        lambda s: ", ".join(str(int(v)) for v in sorted(s))
    )
    table["at step"] = models.map(steps).fillna("–")
    return table.rename(columns={"captured_with": "attention", "feature_dim": "F"})


def rank_table(frame: pd.DataFrame, part: str = "gaussian") -> pd.DataFrame:
    """Mean over seeds of each rank measure per (method, F, N), with the bound min(F, N)."""
    rows = frame[(frame["part"] == part) & frame["metric"].isin(MEASURES)]
    table = (
        rows.groupby(["method", "feature_dim", "n", "metric"])["value"]
        .mean()
        .unstack("metric")
        .reset_index()
    )
    softmax = table["method"] == "softmax"
    table["bound"] = table[["feature_dim", "n"]].min(axis=1).where(~softmax, table["n"])
    table = table.rename(columns={"n": "N", "feature_dim": "F"})
    return table[["method", "F", "N", *MEASURES, "bound"]]


def summarize(frame: pd.DataFrame, params: dict, tables: dict | None = None) -> str:
    has_gaussian = (frame["part"] == "gaussian").any()
    parts = [
        _gaussian_summary(frame, params)
        if has_gaussian
        else not_run_section("Gaussian q/k", "gaussian")
    ]
    spectra = (tables or {}).get("spectra")
    if spectra is not None and (spectra["part"] == "gaussian").any():
        parts.append(_spectra_summary(spectra, params))
    if not (frame["part"] == "copy").any():
        parts.append(not_run_section("Copy task", "copy"))
    else:
        c = params["copy"]
        kernel_and_softmax = frame[frame["part"] == "copy"]
        kernel = kernel_and_softmax[kernel_and_softmax["method"] != "softmax"]
        copy_f = kernel.groupby("method")["feature_dim"].max()
        own = ", ".join(
            f"{m} F={int(f)}" for m, f in copy_f.items() if f and int(f) != c["feature_dim"]
        )  # maps whose F is fixed by D (hedgehog: 2D)
        parts.append(
            f"## Copy task (sequences of {c['copy_len']} symbols, 1 layer, 1 head, "
            f"d_model={c['d_model']}, kernel maps at F={c['feature_dim']}"
            f"{f'; {own}' if own else ''}): validation token "
            f"accuracy on the copied half (chance: 1/{c['n_symbols']}), mean over "
            f"{seed_count(kernel_and_softmax, c['seeds'])} seed(s), and each seed's at the "
            "last step (sorted)\n\n" + markdown_table(copy_table(frame))
        )
        captured = (
            "## Ranks on captured q/k (trained copy models, one validation sequence of "
            f"N={2 * c['copy_len'] + 2}; non-causal matrices; the softmax model's q/k also run "
            "through every map at the same F). Each model is measured with the weights of its "
            "best validation step, which the trainer restores at the end (not the last step's "
            "of the table above): their validation accuracy (mean over seeds) and steps "
            "beside\n\n" + markdown_table(captured_table(frame))
        )
        if params.get("extra_maps"):  # the softmax model's run has the registered maps only
            captured += (
                "\n\nThe maps of extra_maps are measured on Gaussian q/k only; a map of "
                "copy.models has its own trained model's row here."
            )
        softmax = frame[(frame["part"] == "copy") & (frame["method"] == "softmax")]
        expected = _captured_maps(params["exclude_maps"])
        missing = sorted(set(expected) - set(softmax["captured_with"].dropna()))
        if len(softmax) and missing:  # registered after the softmax model's run
            captured += (
                f"\n\nNot in this table: {', '.join(missing)} (registered after the softmax "
                "copy model ran; `--force --only part=copy --only method=softmax` retrains it)."
            )
        parts.append(captured)
    return "\n\n".join(parts)


def seed_count(rows: pd.DataFrame, configured: int) -> str:
    """How many seeds the means of ``rows`` are over, per (method, F, N): ``configured``
    when every group has that many, else their range and the configured count (a partial
    run, e.g. interrupted or ``--only seed=0``, has fewer)."""
    keys = [c for c in ("method", "feature_dim", "n") if c in rows]  # a copy-only run: no n
    counts = rows.groupby(keys, dropna=False)["seed"].nunique()
    lo, hi = (int(counts.min()), int(counts.max())) if len(counts) else (0, 0)
    if lo == hi == configured:
        return str(configured)
    have = str(lo) if lo == hi else f"{lo}–{hi}"
    return f"{have} (of {configured} configured: a partial run)"


def rank_bound_holds(frame: pd.DataFrame) -> bool:
    """Whether every Gaussian matrix (each seed's, not the mean over seeds: ranks 9 and 7
    under a bound of 8 average to 8) has numerical rank <= min(F, N) (softmax: N)."""
    rows = frame[(frame["part"] == "gaussian") & (frame["metric"] == "numerical_rank")]
    n = pd.to_numeric(rows["n"])
    bound = pd.to_numeric(rows["feature_dim"]).clip(upper=n).where(rows["method"] != "softmax", n)
    return bool((pd.to_numeric(rows["value"]) <= bound).all())


def _gaussian_summary(frame: pd.DataFrame, params: dict) -> str:
    table = rank_table(frame)
    d, n_fixed = params["head_dim"], params["fixed_n"]
    softmax = table["method"] == "softmax"
    by_n = table[_swept_n(table, "F", "N")]
    by_f = table[(table["N"] == n_fixed) & ~softmax]
    holds = rank_bound_holds(frame)
    gaussian = frame[(frame["part"] == "gaussian") & (frame["metric"] == "numerical_rank")]
    return "\n\n".join(
        [
            f"Gaussian q/k (D={d}, entries ~ N(0, {params['std']}²)); mean over "
            f"{seed_count(gaussian, params['seeds'])} seeds. Numerical rank counts singular "
            "values above σ_max·N·eps(float64); bound = min(F, N) for kernel maps (F = 0 means "
            "softmax, bound N). Kernel rank ≤ F holds in every row: "
            + ("yes" if holds else "**no**"),
            f"## Rank vs N (maps at F = D = {d}, or at their own fixed F)\n\n"
            + markdown_table(by_n.sort_values(["method", "N"])),
            f"## Rank vs F (N = {n_fixed})\n\n" + markdown_table(by_f.sort_values(["method", "F"])),
        ]
    )


def spectra_table(spectra: pd.DataFrame, n: int, head_dim: int) -> pd.DataFrame:
    """σ_i / σ_1 just before and after the kernel bound, i = F and F + 1 (i = D and D + 1 for
    softmax), per Gaussian (method, F) at N = ``n``; median over seeds."""
    rows = spectra[(spectra["part"] == "gaussian") & (spectra["n"] == n)]
    bound = rows["feature_dim"].where(rows["feature_dim"] > 0, head_dim)
    picked = rows.assign(at=(rows["i"] - bound).map({0: "σ_F / σ_1", 1: "σ_F+1 / σ_1"}))
    table = (
        picked.dropna(subset=["at"])
        .pivot_table(
            index=["method", "feature_dim"], columns="at", values="sigma_ratio", aggfunc="median"
        )
        .reset_index()
        .rename(columns={"feature_dim": "F"})
    )
    return table[["method", "F", *(c for c in ("σ_F / σ_1", "σ_F+1 / σ_1") if c in table)]]


def _spectra_summary(spectra: pd.DataFrame, params: dict) -> str:
    n, d = params["fixed_n"], params["head_dim"]
    return (
        f"## Singular-value spectra (N = {n}; spectra.csv)\n\n"
        f"σ_i / σ_1 at i = F and F + 1, median over seeds (the figures plot the mean; "
        f"softmax, F = 0: i = D = {d} and "
        "D + 1; maps with F ≥ N have no such row). A kernel map with F < N drops to round-off "
        "(~1e-15) after F values; softmax does not.\n\n"
        + markdown_table(spectra_table(spectra, n, d))
    )


def figures(frame: pd.DataFrame, params: dict, tables: dict | None = None) -> dict:
    figs = {}
    rows = frame[frame["part"] == "gaussian"]
    if not rows.empty:
        figs |= _gaussian_figures(rows, params)
    spectra = (tables or {}).get("spectra")
    if spectra is not None and not spectra.empty:
        figs |= _spectra_figures(spectra, params)
    curves = frame[(frame["part"] == "copy") & frame["metric"].isin(["val_accuracy", "val_loss"])]
    if not curves.empty:
        fig = ks.analysis.plots.plot_history(curves, x="step", hue="method")
        c = params["copy"]
        ks.analysis.plots.figure_title(
            fig,
            f"Copy task (sequences of {c['copy_len']} symbols): validation token accuracy on "
            f"the copied half and loss by training step\nmean ± 1 sd over {_seeds(curves)}; "
            f"1 layer, 1 head, d_model = {c['d_model']} (the summary gives each map's F)",
        )
        figs["copy_accuracy"] = fig
    return figs


def _seeds(rows: pd.DataFrame) -> str:
    """``"3 seeds"`` (``"1 seed"``): how many seeds ``rows`` hold, for a figure's title."""
    k = rows["seed"].nunique()
    return f"{k} seed{'' if k == 1 else 's'}"


def _gaussian_figures(rows: pd.DataFrame, params: dict) -> dict:
    """Rank vs N and rank vs F of the Gaussian part (each only when it has rows)."""
    d = params["head_dim"]
    by_n = _n_sweep(rows, d)
    by_f = rows[(rows["n"] == params["fixed_n"]) & (rows["method"] != "softmax")]
    figs = {}
    for measure in ("numerical_rank", "effective_rank"):
        what = f"{ks.analysis.plots.metric_label(measure).capitalize()} of the N×N attention matrix"
        if not by_n.empty:
            fig = ks.analysis.plots.plot_rank(by_n, measure=measure, x="n")
            ks.analysis.plots.figure_title(
                fig, f"{what} by N\nD = {d}, F = D unless labelled; mean ± 1 sd over {_seeds(by_n)}"
            )
            figs[f"{measure}_vs_n"] = fig
        if not by_f.empty:
            fig = ks.analysis.plots.plot_rank(by_f, measure=measure, x="feature_dim")
            ks.analysis.plots.figure_title(
                fig,
                f"{what} by feature dimension F\nN = {params['fixed_n']}, D = {d}; mean ± 1 sd "
                f"over {_seeds(by_f)}",
            )
            figs[f"{measure}_vs_f"] = fig
    return figs


def _swept_n(rows: pd.DataFrame, f: str = "feature_dim", n: str = "n") -> pd.Series:
    """Which rows belong to the N sweep: their (method, F) was measured at several N (F = D,
    or a map's own fixed F such as hedgehog's 2D; softmax has F = 0)."""
    return rows.groupby(["method", f])[n].transform("nunique") > 1


def _n_sweep(rows: pd.DataFrame, d: int) -> pd.DataFrame:
    """The rows of the N sweep, with ``method`` labelled "name (F=f)" where F ≠ D."""
    out = rows[_swept_n(rows)]
    label = [
        m if f in (0, d) else f"{m} (F={f})"
        for m, f in zip(out.method, out.feature_dim, strict=True)
    ]
    return out.assign(method=label)


def _spectra_figures(spectra: pd.DataFrame, params: dict) -> dict:
    """``spectra``: every method at its N-sweep F (F = D unless labelled), N = fixed_n;
    ``spectra_vs_f``: the maps measured at several F, one panel each, at N = fixed_n.
    Mean of σ_i/σ_1 over seeds."""
    gauss = spectra[spectra["part"] == "gaussian"]
    rows = gauss[gauss["n"] == params["fixed_n"]]
    if rows.empty:
        return {}
    at_d = _n_sweep(gauss, params["head_dim"])
    at_d = at_d[at_d["n"] == params["fixed_n"]]
    figs = {}
    if not at_d.empty:
        fig = ks.analysis.plots.plot_spectra(at_d, hue="method")
        ks.analysis.plots.figure_title(
            fig,
            "Normalized singular values of the N×N attention matrix\n"
            f"N = {params['fixed_n']}, D = {params['head_dim']}, F = D unless labelled; mean "
            "over seeds",
        )
        figs["spectra"] = fig
    several = rows.groupby("method")["feature_dim"].transform("nunique") > 1
    if several.any():
        fig = ks.analysis.plots.plot_spectra(
            rows[several].rename(columns={"feature_dim": "F"}), hue="F", col="method"
        )
        ks.analysis.plots.figure_title(
            fig,
            "Normalized singular values of the N×N attention matrix at several F\n"
            f"N = {params['fixed_n']}, D = {params['head_dim']}; mean over seeds",
        )
        figs["spectra_vs_f"] = fig
    return figs


if __name__ == "__main__":
    raise SystemExit(main("rank"))
