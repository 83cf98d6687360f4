"""An ``on_eval`` callback that reports to an Optuna trial and prunes it."""

from __future__ import annotations

from typing import Any


class OptunaPruningCallback:
    """``Trainer(..., on_eval=OptunaPruningCallback(trial, "val_accuracy"))``.

    After each evaluation: ``trial.report(metrics[monitor], step)``, then raise
    ``optuna.TrialPruned`` when ``trial.should_prune()``; the exception leaves
    :meth:`Trainer.fit` unchanged (after the run record is written, status ``pruned``).
    The run's last evaluation (``metrics["final"]``: its last step, or an early stop) is
    reported but never prunes: the training it would save is done, and pruning there
    dropped a finished run's result (no test accuracy, not a candidate for the best trial).
    """

    def __init__(self, trial: Any, monitor: str = "val_accuracy") -> None:
        self.trial, self.monitor = trial, monitor

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        import optuna

        if self.monitor not in metrics:
            raise ValueError(f"monitor {self.monitor!r} is not a metric; have {sorted(metrics)}")
        value = float(metrics[self.monitor])
        self.trial.report(value, step)
        if not metrics.get("final") and self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at step {step} ({self.monitor}={value:.4g})")
