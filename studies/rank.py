"""Attention rank: softmax attention is (numerically) full rank, kernel attention with F
features has rank <= F. Numerical rank (at a stated tolerance), effective rank and stable rank
as N and F grow, on Gaussian and on captured queries/keys; plus the copy experiment."""

from __future__ import annotations

import pandas as pd

import kernelstudy as ks
from kernelstudy.study import main, markdown_table

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
    out = []
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
    return figs


if __name__ == "__main__":
    raise SystemExit(main("rank"))
