"""Optuna searches over feature maps: configs, search spaces, storages by URL, workers,
the objective (with the feature-map parameter budget), evaluation with seeds and reports."""

from .config import SearchConfig, Variant, load_config
from .evaluate import read_evaluation, run_evaluation, summarize_evaluation
from .objective import check_variants, prepare_data, suggest_settings, train_run
from .report import (
    PAPER,
    figures,
    load_results,
    paper_table,
    results_table,
    trials_frame,
    write_report,
)
from .runner import best_trial, run_search, search_summary
from .storage import default_storage_url, load_study, open_storage
from .workers import open_study, requeue_failed, run_workers

__all__ = [
    "PAPER",
    "SearchConfig",
    "Variant",
    "best_trial",
    "check_variants",
    "default_storage_url",
    "figures",
    "load_config",
    "load_results",
    "load_study",
    "open_storage",
    "open_study",
    "paper_table",
    "prepare_data",
    "read_evaluation",
    "requeue_failed",
    "results_table",
    "run_evaluation",
    "run_search",
    "run_workers",
    "search_summary",
    "suggest_settings",
    "summarize_evaluation",
    "train_run",
    "trials_frame",
    "write_report",
]
