"""Attention rank: softmax attention is (numerically) full rank, kernel attention with F
features has rank <= F. Numerical rank (at a stated tolerance), effective rank and stable rank
as N and F grow, on Gaussian and on captured queries/keys; plus the copy experiment."""

from __future__ import annotations

import pandas as pd
import torch

import kernelstudy as ks
from kernelstudy.study import main, markdown_table
from kernelstudy.tasks import CopyTask
from kernelstudy.train.trainer import TrainConfig, Trainer

MEASURES = ("numerical_rank", "effective_rank", "stable_rank")


def _maps(params: dict) -> list[str]:
    return [m for m in ks.list_feature_maps() if m not in params["exclude_maps"]]


def configs(params: dict) -> list[dict]:
    """Gaussian part: one config per (method, F, N, seed): the N sweep at F = D and the F sweep
    at N = fixed_n. Methods: softmax (N sweep only) and every registered map (a map whose F is
    fixed, such as elu with F = D, enters at its own F only)."""
    d = params["head_dim"]
    points = [(d, n) for n in params["seq_lens"]]
    points += [(f, params["fixed_n"]) for f in params["feature_dims"]]
    todo = [("softmax", 0, n) for n in params["seq_lens"]]
    for name in _maps(params):
        for target, n in points:
            f = ks.analysis.matched_feature_map(name, d, target).feature_dim
            todo.append((name, f, n))
    out = _copy_configs(params)
    for method, f, n in sorted(set(todo)):
        for seed in range(params["seeds"]):
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


def run_config(config: dict, device: str) -> list[dict]:
    if config["part"] == "copy":
        return _run_copy(config, device)
    d, n, seed = config["head_dim"], config["n"], config["seed"]
    q, k = ks.analysis.gaussian_qk(n, d, config["std"], seed=10_000 + seed, device=device)
    feature_map = config["method"]
    if feature_map != "softmax":
        feature_map = ks.analysis.matched_feature_map(
            feature_map, d, config["feature_dim"], seed=seed
        ).to(device)
    A = ks.analysis.attention_matrix(q.double(), k.double(), feature_map)[0, 0]
    ranks = ks.analysis.attention_rank(A)
    rows = [{"metric": m, "value": float(ranks[m])} for m in MEASURES]
    return [*rows, {"metric": "tol", "value": ranks["tol"]}]


# --- the copy experiment: "do we need full rank?" ---------------------------------------------


def _copy_configs(params: dict) -> list[dict]:
    c = params["copy"]
    known = ["softmax", *ks.list_feature_maps()]
    return [
        {
            "part": "copy",
            "method": name,
            "seed": seed,
            **{k: v for k, v in c.items() if k not in ("models", "seeds")},
        }
        for name in c["models"]
        if name in known
        for seed in range(c["seeds"])
    ]


def _copy_model(config: dict, vocab_size: int, max_len: int) -> ks.nn.CausalLM:
    feature_map = None
    if config["method"] != "softmax":
        feature_map = ks.analysis.matched_feature_map(
            config["method"], config["d_model"], config["feature_dim"], seed=config["seed"]
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


def _run_copy(config: dict, device: str) -> list[dict]:
    """Train one model on the copy task; rows: validation curves, then attention ranks."""
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
    trainer.fit()
    f = model.feature_dim or 0
    rows = []
    for _, row in trainer.metrics.iterrows():
        for metric in ("val_accuracy", "val_sequence_accuracy", "val_loss"):
            rows.append(
                {"step": int(row["step"]), "feature_dim": f, "metric": metric, "value": row[metric]}
            )
    ids = val[0]["input_ids"][None].to(trainer.device)
    return rows + _captured_ranks(model.eval(), ids, config, f)


def _captured_ranks(model: ks.nn.CausalLM, ids: torch.Tensor, config: dict, f: int) -> list[dict]:
    """Ranks of the non-causal attention matrices built from the trained model's own q/k
    (one validation sequence): with its own attention, and — for the softmax model — with
    every registered map at F = feature_dim applied to the captured q/k."""
    (q, k), *_ = ks.analysis.capture_qk(model, ids).values()
    q, k = q.double(), k.double()
    if config["method"] == "softmax":
        maps = {"softmax": "softmax"}
        for name in ks.list_feature_maps():
            if name != "identity":
                maps[name] = ks.analysis.matched_feature_map(
                    name, q.shape[-1], config["feature_dim"], seed=config["seed"]
                )
    else:
        maps = {config["method"]: model.encoder.layers[0].attn.feature_map}
    rows = []
    for name, fm in maps.items():
        A = ks.analysis.attention_matrix(q, k, fm)[0, 0]
        ranks = ks.analysis.attention_rank(A)
        dim = 0 if name == "softmax" else fm.feature_dim
        for m in MEASURES:
            rows.append(
                {"captured_with": name, "feature_dim": dim, "metric": m, "value": float(ranks[m])}
            )
    return rows


def copy_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Validation accuracy of each model at a few steps (mean over seeds)."""
    rows = frame[(frame["part"] == "copy") & (frame["metric"] == "val_accuracy")]
    table = rows.pivot_table(index="method", columns="step", values="value", aggfunc="mean")
    steps = list(table.columns)
    keep = sorted({steps[len(steps) * i // 4] for i in range(1, 4)} | {steps[-1]})
    table = table[keep]
    table.columns = [f"step {int(s)}" for s in keep]
    return table.reset_index()


def captured_table(frame: pd.DataFrame) -> pd.DataFrame:
    rows = frame[(frame["part"] == "copy") & frame["metric"].isin(MEASURES)].copy()
    rows["trained model"] = rows["method"]
    table = rows.pivot_table(
        index=["trained model", "captured_with", "feature_dim"],
        columns="metric",
        values="value",
        aggfunc="mean",
    )
    return table.reset_index().rename(columns={"captured_with": "attention", "feature_dim": "F"})


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


def summarize(frame: pd.DataFrame, params: dict) -> str:
    parts = [_gaussian_summary(frame, params)]
    if (frame["part"] == "copy").any():
        c = params["copy"]
        parts.append(
            f"## Copy task (sequences of {c['copy_len']} symbols, 1 layer, 1 head, "
            f"d_model={c['d_model']}, kernel maps at F={c['feature_dim']}): validation token "
            f"accuracy on the copied half, mean over {c['seeds']} seed(s)\n\n"
            + markdown_table(copy_table(frame))
        )
        parts.append(
            "## Ranks on captured q/k (trained copy models, one validation sequence of "
            f"N={2 * c['copy_len'] + 2}; non-causal matrices; the softmax model's q/k also run "
            "through every map at the same F)\n\n" + markdown_table(captured_table(frame))
        )
    return "\n\n".join(parts)


def _gaussian_summary(frame: pd.DataFrame, params: dict) -> str:
    table = rank_table(frame)
    d, n_fixed = params["head_dim"], params["fixed_n"]
    softmax = table["method"] == "softmax"
    by_n = table[(table["F"] == d) | softmax]
    by_f = table[(table["N"] == n_fixed) & ~softmax]
    holds = (table["numerical_rank"] <= table["bound"]).all()
    return "\n\n".join(
        [
            f"Gaussian q/k (D={d}, entries ~ N(0, {params['std']}²)); mean over "
            f"{params['seeds']} seeds. Numerical rank counts singular values above "
            "σ_max·N·eps(float64); bound = min(F, N) for kernel maps (F = 0 means softmax, bound "
            "N). Kernel rank ≤ F holds in every row: " + ("yes" if holds else "**no**"),
            f"## Rank vs N (maps at F ≈ {d})\n\n"
            + markdown_table(by_n.sort_values(["method", "N"])),
            f"## Rank vs F (N = {n_fixed})\n\n" + markdown_table(by_f.sort_values(["method", "F"])),
        ]
    )


def figures(frame: pd.DataFrame, params: dict) -> dict:
    rows = frame[frame["part"] == "gaussian"]
    d = params["head_dim"]
    by_n = rows[(rows["feature_dim"] == d) | (rows["method"] == "softmax")]  # F = 0 for softmax
    by_f = rows[(rows["n"] == params["fixed_n"]) & (rows["method"] != "softmax")]
    figs = {}
    for measure in ("numerical_rank", "effective_rank"):
        figs[f"{measure}_vs_n"] = ks.analysis.plots.plot_rank(by_n, measure=measure, x="n")
        figs[f"{measure}_vs_f"] = ks.analysis.plots.plot_rank(
            by_f, measure=measure, x="feature_dim"
        )
    curves = frame[(frame["part"] == "copy") & frame["metric"].isin(["val_accuracy", "val_loss"])]
    if not curves.empty:
        figs["copy_accuracy"] = ks.analysis.plots.plot_history(curves, x="step", hue="method")
    return figs


if __name__ == "__main__":
    raise SystemExit(main("rank"))
