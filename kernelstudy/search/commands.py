"""The ``search``, ``evaluate`` and ``report`` commands of the ``kernelstudy`` CLI.

Errors in the inputs (config, storage URL, data) raise ValueError or
FileNotFoundError before any training; ``kernelstudy.cli.main`` prints them and
exits 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..arguments import nonempty_user_path


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage",
        metavar="URL",
        default=None,
        help="Optuna storage URL (default: sqlite file OUT/NAME/optuna.db); a PostgreSQL "
        "URL lets workers on many machines share the study",
    )
    p.add_argument("--quick", action="store_true", help="use the config's [quick] sizes")
    p.add_argument(
        "--out",
        default=None,
        type=nonempty_user_path,
        metavar="DIR",
        help="results directory (default $KERNELSTUDY_RESULTS, else results/ of the checkout "
        "or, installed, of the working directory, or beside $KERNELSTUDY_STUDIES_DIR where "
        "set: where the studies and notebooks read)",
    )


def _variants(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--variant",
        action="append",
        metavar="LABEL",
        help="only this variant (repeatable; default: all)",
    )
    p.add_argument("--device", default=None, help="torch device (default: the config's, auto)")


def _positive(text: str) -> int:
    """An argparse type: a positive int (the message names no function)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def _run_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options that search and evaluate share."""
    return {
        "storage": args.storage,
        "out": args.out,
        "quick": args.quick,
        "variants": args.variant,
        "device": args.device,
    }


def _cmd_search(args: argparse.Namespace) -> int:
    from .runner import run_search
    from .storage import redact
    from .workers import TrialsKeepFailing

    try:
        summary = run_search(
            args.config, trials=args.trials, workers=args.workers, **_run_options(args)
        )
    except TrialsKeepFailing as err:  # the trials are kept; a rerun retries the failed ones
        print(f"kernelstudy search: error: {err}", file=sys.stderr)
        return 1
    _print(summary)
    if args.storage:
        print(f"studies in {redact(args.storage)}")
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from .evaluate import run_evaluation

    summary = run_evaluation(args.config, seeds=args.seeds, **_run_options(args))
    if len(summary):
        print(
            "test accuracy as a fraction (0-1) over each variant's n runs: mean, std (ddof=1); "
            "best_by_val: the run of highest validation accuracy; max_test: the highest test "
            "accuracy (chosen on the test set); diverged: runs not in n"
        )
    _print(summary)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import write_report

    paths = write_report(args.target, storage=args.storage, out=args.out, quick=args.quick)
    print(paths["table_md"].read_text(encoding="utf-8"), end="")
    for key, path in paths.items():
        print(f"{key}: {path}")
    return 0


def _print(frame: Any) -> None:
    if len(frame):
        print(frame.to_string(index=False, float_format=lambda v: f"{v:.4g}"))


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``search``, ``evaluate`` and ``report`` on the CLI's subparsers."""
    p = sub.add_parser(
        "search",
        help="Optuna search over a study config's variants",
        description="Run an Optuna study per variant of CONFIG with K worker processes; "
        "the same command with the same --storage on another machine joins the studies, "
        "and running it again resumes them.",
    )
    p.add_argument("config", metavar="CONFIG", help="study config, e.g. studies/lra_listops.toml")
    p.add_argument(
        "--trials",
        type=_positive,
        default=None,
        help="trained trials per variant (default: the config's; trials pruned before "
        "training, over the budget or refused, do not count: a variant gives up after its "
        "first TRIALS all were, or after 5xTRIALS in all); with several workers a trial "
        "running when the count is reached still finishes (up to workers-1 more)",
    )
    p.add_argument("--workers", type=_positive, default=1, help="worker processes (default 1)")
    _common(p)
    _variants(p)
    p.set_defaults(func=_cmd_search)

    p = sub.add_parser(
        "evaluate",
        help="re-train each variant's best configuration with several seeds",
        description="Re-train the best trial of each variant with N seeds (0, 1, ... without "
        "the search's own [train] seed, whose run won the search) and report "
        "test accuracy mean, std, best_by_val (the run of best validation accuracy) and "
        "max_test (resumable: finished seeds are skipped).",
    )
    p.add_argument("config", metavar="CONFIG", help="study config")
    p.add_argument("--seeds", type=_positive, default=5, help="seeds per variant (default 5)")
    _common(p)
    _variants(p)
    p.set_defaults(func=_cmd_evaluate)

    p = sub.add_parser(
        "report",
        help="results table and figures of searches and evaluations",
        description="Write the paper-shaped table (CSV, markdown) and figures for one or more "
        "configs or study names.",
    )
    p.add_argument(
        "target", nargs="+", metavar="CONFIG_OR_STUDY", help="config file(s) or study name(s)"
    )
    _common(p)
    p.set_defaults(func=_cmd_report)
