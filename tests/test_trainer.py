"""The trainer: learning, exact resume, early stopping, outputs, Optuna pruning, regularizers."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import time

import numpy as np
import optuna
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import kernelstudy as ks
from kernelstudy.tasks import CopyTask, ListOpsTask, write_listops
from kernelstudy.train import (
    Objective,
    OptunaPruningCallback,
    TrainConfig,
    Trainer,
    WarmupDecay,
    model_for_task,
)
from kernelstudy.train.interrupt import DeferredInterrupt
from kernelstudy.train.trainer import resume_changes

from .test_models import SMALL, TEST_MAP
from .test_tasks_loaders import DeclaredArray

pytestmark = pytest.mark.usefixtures("one_thread")


class ContainsTask(Dataset):
    """Classification: label 1 when token 3 occurs among the real tokens; variable lengths."""

    vocab_size, num_classes, pairs = 8, 2, False

    def __init__(self, size: int, length: int = 12, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 8, (size, length), generator=g)
        lengths = torch.randint(4, length + 1, (size,), generator=g)
        self.mask = torch.arange(length)[None, :] < lengths[:, None]
        self.label = ((self.ids == 3) & self.mask).any(1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "mask": self.mask[i], "label": self.label[i]}


class PairTask(ContainsTask):
    """Matching: label 1 when both documents contain token 3."""

    pairs = True

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        j = (i + 1) % len(self)
        return {
            "input_ids_1": self.ids[i],
            "mask_1": self.mask[i],
            "input_ids_2": self.ids[j],
            "mask_2": self.mask[j],
            "label": self.label[i] & self.label[j],
        }


def _classifier(attention="elu", dropout=0.0, **kw):
    return ks.nn.SequenceClassifier(
        8, 2, attention=attention, **{**SMALL, "dropout": dropout, **kw}
    )


def _config(**kw) -> TrainConfig:
    base = {"steps": 12, "batch_size": 16, "lr": 3e-3, "eval_every": 4, "progress": False}
    base["device"] = "cpu"  # bit-exact and CPU-memory checks, also where a GPU is present
    return TrainConfig(**{**base, **kw})


def test_loss_decreases_on_a_learnable_task():
    torch.manual_seed(0)
    train, val = ContainsTask(512), ContainsTask(128, seed=1)
    trainer = Trainer(_classifier(), train, _config(steps=60, eval_every=20), val_data=val)
    record = trainer.fit()
    hist = trainer.metrics
    assert list(hist["step"]) == [20, 40, 60]
    assert hist["train_loss"].iloc[-1] < 0.7 * hist["train_loss"].iloc[0]
    assert hist["val_accuracy"].iloc[-1] > 0.8
    assert record["status"] == "completed" and record["steps_completed"] == 60
    assert record["best"]["value"] == hist["val_accuracy"].max()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("loader", [False, True])
def test_a_finished_fit_holds_no_dataloader_workers(loader):
    """A fit that returned kept its loader's iterator, and so its worker processes (idle,
    with their file descriptors and threads), as long as its Trainer lived: a notebook
    keeping trainers to compare ran out of files. The next fit starts them again at the
    same position: the weights and the global random state are the uninterrupted run's.
    A loader of one's own keeps its iterator (a restart would replay its epoch: exact only
    where torch's generators hold all its randomness)."""
    import multiprocessing

    train = ContainsTask(100)

    def run(pauses):
        torch.manual_seed(0)
        data = DataLoader(train, 16, shuffle=True, num_workers=2) if loader else train
        cfg = _config(steps=12, eval_every=0, num_workers=0 if loader else 2)
        trainer = Trainer(_classifier(dropout=0.2), data, cfg)
        for stop in pauses:
            trainer.fit(stop_after=stop)
            assert bool(multiprocessing.active_children()) == loader
        trainer.fit()
        return _params(trainer.model), torch.rand(1)

    (straight, after), (paused, after_paused) = run([]), run([3, 8])
    assert all(torch.equal(straight[k], paused[k]) for k in straight)
    assert torch.equal(after, after_paused)


@pytest.mark.parametrize("loader", [False, True])
def test_interrupted_and_resumed_run_is_bit_identical(tmp_path, loader):
    """k steps + resume + k steps == 2k steps, with dropout, shuffling and a partial
    accumulation window (the pause is not at an evaluation)."""
    train, val = ContainsTask(100), ContainsTask(40, seed=1)

    def data():  # a user DataLoader shuffling from the global generator, or the Dataset
        return DataLoader(train, batch_size=16, shuffle=True) if loader else train

    cfg = {"steps": 14, "eval_every": 4, "warmup_steps": 3, "schedule": "linear"}
    torch.manual_seed(0)
    straight = Trainer(_classifier(dropout=0.2), data(), _config(**cfg), val_data=val)
    straight.fit()

    out = str(tmp_path / "run")
    torch.manual_seed(0)
    first = Trainer(_classifier(dropout=0.2), data(), _config(out_dir=out, **cfg), val_data=val)
    paused = first.fit(stop_after=7)
    assert paused["status"] == "paused" and paused["steps_completed"] == 7
    torch.manual_seed(123)  # a different init and global state: all comes from the checkpoint
    second = Trainer(_classifier(dropout=0.2), data(), _config(out_dir=out, **cfg), val_data=val)
    resumed = second.fit(resume=True)
    assert resumed["status"] == "completed" and second.step == 14

    a, b = _params(straight.model), _params(second.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    drop = ["elapsed_s"]
    pd.testing.assert_frame_equal(
        straight.metrics.drop(columns=drop), second.metrics.drop(columns=drop)
    )
    on_disk = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert list(on_disk["step"]) == [4, 8, 12, 14]


class _NumpyAugmentedTask(ContainsTask):
    """ContainsTask whose items blank one token chosen by NumPy's global generator."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = dict(super().__getitem__(i))
        ids = item["input_ids"].clone()
        ids[np.random.randint(len(ids))] = 0
        return {**item, "input_ids": ids}


def test_a_resumed_run_restores_numpys_global_generator(tmp_path):
    """The checkpoint's RNG states include NumPy's: a dataset augmenting with np.random
    resumes bit-identically, and NumPy's state after the resumed run is the straight run's
    (not as the new process had it)."""
    cfg = {"steps": 4, "batch_size": 8, "eval_every": 2}
    torch.manual_seed(0)
    np.random.seed(0)
    straight = Trainer(_classifier(), _NumpyAugmentedTask(48), _config(**cfg))
    straight.fit()
    after_straight = np.random.get_state()[1].copy()

    out = str(tmp_path / "run")
    torch.manual_seed(0)
    np.random.seed(0)
    Trainer(_classifier(), _NumpyAugmentedTask(48), _config(out_dir=out, **cfg)).fit(stop_after=2)
    np.random.seed(99)  # another process's state: all must come from the checkpoint
    second = Trainer(_classifier(), _NumpyAugmentedTask(48), _config(out_dir=out, **cfg))
    second.fit(resume=True)
    np.testing.assert_array_equal(np.random.get_state()[1], after_straight)
    a, b = _params(straight.model), _params(second.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_early_stopping(tmp_path):
    train = ContainsTask(64)
    cfg = _config(steps=100, eval_every=2, lr=1e-9, patience=2, out_dir=str(tmp_path))
    trainer = Trainer(_classifier(), train, cfg, val_data=train)
    record = trainer.fit()
    # the first evaluation sets the best; two more without improvement stop the run
    assert record["status"] == "early_stopped" and record["stopped_early"]
    assert record["steps_completed"] == 6 and len(trainer.metrics) == 3
    assert record["best"]["step"] == 2
    with pytest.raises(ValueError, match="val_data"):
        Trainer(_classifier(), train, _config(patience=2))


def test_outputs_metrics_csv_and_run_record(tmp_path):
    torch.manual_seed(0)
    train, val = ContainsTask(64), ContainsTask(32, seed=1)
    model = _classifier(attention="kernel", feature_map=TEST_MAP)
    cfg = _config(steps=8, out_dir=str(tmp_path / "run"), reg_weight=0.1)
    trainer = Trainer(model, train, cfg, val_data=val, test_data=val)
    trainer.fit()
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} == {
        "checkpoint.pt",
        "metrics.csv",
        "run.json",
        "model.pt",
    }
    csv = pd.read_csv(run / "metrics.csv")
    pd.testing.assert_frame_equal(csv, trainer.metrics, check_dtype=False)
    for col in ("step", "lr", "train_loss", "train_accuracy", "train_reg", "grad_norm"):
        assert col in csv and csv[col].notna().all()
    record = json.loads((run / "run.json").read_text())
    assert record["parameters"]["total"] == model.parameter_count()
    assert record["parameters"]["feature_map"] == model.feature_map_parameter_count() == 96
    assert record["feature_dim"] == 6
    assert record["peak_memory_bytes"] > 0 and record["peak_memory_source"] == "cpu_max_rss"
    assert set(record["test"]) == {"loss", "accuracy"}
    assert record["model"]["class"] == "SequenceClassifier"
    assert record["config"]["reg_weight"] == 0.1
    assert not list(run.glob("*.tmp"))  # atomic writes leave no temp files


class _PenalizedModel(nn.Module):
    """A classifier plus a parameter that only the regularizer sees."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _classifier()
        self.extra = nn.Parameter(torch.ones(3))

    def forward(self, input_ids, mask=None):
        return self.inner(input_ids, mask)

    def regularization(self) -> torch.Tensor:
        return self.extra.square().sum()


@pytest.mark.parametrize("reg_weight", [0.0, 0.5])
def test_regularizer_enters_the_loss(reg_weight):
    model = _PenalizedModel()
    trainer = Trainer(
        model, ContainsTask(32), _config(steps=4, weight_decay=0.0, reg_weight=reg_weight)
    )
    trainer.fit()
    if reg_weight == 0:
        assert torch.equal(model.extra.detach(), torch.ones(3))
        assert "train_reg" not in trainer.metrics
    else:
        assert (model.extra.detach() < 1).all()
        assert trainer.metrics["train_reg"].iloc[-1] == pytest.approx(3.0, rel=0.05)


def test_feature_map_regularizer_is_trained_down():
    after = {}
    for reg_weight in (0.0, 10.0):
        torch.manual_seed(0)
        model = _classifier(attention="kernel", feature_map=TEST_MAP)
        before = model.regularization().item()
        cfg = _config(steps=10, lr=1e-2, reg_weight=reg_weight, schedule="constant")
        Trainer(model, ContainsTask(32), cfg).fit()
        after[reg_weight] = model.regularization().item()
    assert after[10.0] < 0.5 * before < after[0.0]


def test_optuna_pruning_propagates(tmp_path):
    study = optuna.create_study(
        direction="maximize", pruner=optuna.pruners.ThresholdPruner(lower=2.0)
    )  # every reported accuracy (<= 1) is below the threshold: prune at the first report
    out = tmp_path / "trial"

    def objective(trial: optuna.Trial) -> float:
        cfg = _config(lr=trial.suggest_float("lr", 1e-3, 1e-2, log=True), out_dir=str(out))
        data = ContainsTask(32)
        callback = OptunaPruningCallback(trial, "val_accuracy")
        return Trainer(_classifier(), data, cfg, val_data=data, on_eval=callback).fit()["best"][
            "value"
        ]

    study.optimize(objective, n_trials=1)
    trial = study.trials[0]
    assert trial.state == optuna.trial.TrialState.PRUNED
    assert list(trial.intermediate_values) == [4]
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "pruned" and "TrialPruned" in record["error"]
    assert record["steps_completed"] == 4

    seen = []
    with pytest.raises(optuna.TrialPruned):
        Trainer(
            _classifier(),
            ContainsTask(32),
            _config(),
            on_eval=[
                lambda s, m: seen.append(s),
                OptunaPruningCallback(_AlwaysPrune(), "train_loss"),
            ],
        ).fit()
    assert seen == [4]


def test_the_last_evaluation_reports_but_does_not_prune(tmp_path):
    """Pruning at the run's last evaluation (its last step, or an early stop) saved no
    training and lost a finished run."""
    data = ContainsTask(32)
    reports = []

    class Recording(_AlwaysPrune):
        def report(self, value: float, step: int) -> None:
            reports.append(step)

    callback = OptunaPruningCallback(Recording(), "val_accuracy")
    record = Trainer(_classifier(), data, _config(steps=4), val_data=data, on_eval=callback).fit()
    assert record["status"] == "completed" and reports == [4]
    with pytest.raises(optuna.TrialPruned, match="step 4"):  # a longer run prunes there
        Trainer(_classifier(), data, _config(steps=8), val_data=data, on_eval=callback).fit()
    reports.clear()  # an early stop at step 6 of 100: its last evaluation does not prune
    cfg = _config(steps=100, eval_every=2, patience=2, monitor="val_loss", mode="min")
    trainer = Trainer(_classifier(), data, cfg, val_data=data)
    _scripted_val_losses(trainer, [0.5, 0.6, 0.7])

    class PruneFromStep6(Recording):
        def should_prune(self) -> bool:
            return reports[-1] >= 6

    trainer.callbacks = [OptunaPruningCallback(PruneFromStep6(), "val_loss")]
    record = trainer.fit()
    assert record["status"] == "early_stopped" and reports == [2, 4, 6]


def _scripted_val_losses(trainer: Trainer, losses: list[float]) -> None:
    """Make ``trainer``'s evaluations (of its validation data: it has no test data) report
    ``losses`` in turn."""
    real, script = trainer.evaluate, iter(losses)

    def evaluate(data, max_batches=None):
        return {**real(data, max_batches), "loss": next(script)}

    trainer.evaluate = evaluate


def test_a_nan_evaluation_is_never_the_best():
    """A NaN first val_loss became the best; every later comparison with it was False, so
    the run stopped early while improving and restore_best loaded the NaN step."""
    data = ContainsTask(32)
    cfg = _config(steps=8, eval_every=2, patience=2, monitor="val_loss", mode="min")
    trainer = Trainer(_classifier(), data, cfg, val_data=data)
    _scripted_val_losses(trainer, [math.nan, 0.4, 0.3, 0.2])
    record = trainer.fit()
    assert record["status"] == "completed" and record["best"] == {
        "monitor": "val_loss",
        "value": 0.2,
        "step": 8,
    }
    trainer = Trainer(_classifier(), data, _config(steps=4, eval_every=2), val_data=data)
    _scripted_val_losses(trainer, [math.nan, math.nan])  # monitor val_accuracy: unaffected
    assert trainer.fit()["best"]["step"] == 4
    cfg = _config(steps=4, eval_every=2, monitor="val_loss", mode="min")
    trainer = Trainer(_classifier(), data, cfg, val_data=data)
    _scripted_val_losses(trainer, [math.nan, math.nan])
    assert trainer.fit()["best"]["value"] is None  # never finite: no best


def test_patience_running_out_at_the_last_step_is_a_completed_run():
    data = ContainsTask(32)
    cfg = _config(steps=6, eval_every=2, patience=2, monitor="val_loss", mode="min")
    trainer = Trainer(_classifier(), data, cfg, val_data=data)
    _scripted_val_losses(trainer, [0.5, 0.6, 0.7])
    record = trainer.fit()
    assert record["status"] == "completed" and record["steps_completed"] == 6
    cfg8 = _config(steps=8, eval_every=2, patience=2, monitor="val_loss", mode="min")
    trainer = Trainer(_classifier(), data, cfg8, val_data=data)
    _scripted_val_losses(trainer, [0.5, 0.6, 0.7, 0.8])
    record = trainer.fit()  # cut short at step 6 of 8
    assert record["status"] == "early_stopped" and record["steps_completed"] == 6


def test_a_checkpoint_cut_anywhere_is_named(tmp_path):
    """A checkpoint cut short mostly raised a bare "[Errno 22] Invalid argument" (OSError
    from the zip reader), not naming the file."""
    from kernelstudy.train.checkpoint import load_checkpoint, save_checkpoint

    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"model": _classifier().state_dict(), "step": 3})
    whole = path.read_bytes()
    cut = tmp_path / "cut.pt"
    for length in range(0, len(whole), max(1, len(whole) // 60)):
        cut.write_bytes(whole[:length])
        with pytest.raises(ValueError, match=r"cut\.pt is not a (readable )?checkpoint"):
            load_checkpoint(cut)
    assert load_checkpoint(path)["step"] == 3


class _RunsCode:
    """Unpickled, it would write a file: what a crafted checkpoint could do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_is_read_without_running_code(tmp_path):
    """Checkpoints were read with weights_only=False: one in a shared run folder, resumed by
    its command, ran whatever its pickle said. A real one still loads (NumPy's RNG array)."""
    from kernelstudy.train.checkpoint import load_checkpoint

    data = ContainsTask(32)
    trainer = Trainer(_classifier(), data, _config(steps=4, out_dir=str(tmp_path)))
    trainer.fit()
    path = tmp_path / "checkpoint.pt"
    state = load_checkpoint(path)
    assert isinstance(state["rng"]["numpy"][1], np.ndarray) and state["step"] == 4
    marker = tmp_path / "code_ran"
    state["history"] = [_RunsCode(str(marker))]
    torch.save(state, path)
    again = Trainer(_classifier(), data, _config(steps=6, out_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"checkpoint\.pt is not read: it refers to _?io\.open"):
        again.fit(resume=True)
    assert not marker.exists()
    # NumPy's array type is allowed for the RNG state, but a call of it (an array of any
    # declared size, nothing behind it in the file) is not; nor _reconstruct of a size
    for how in ("ndarray", "_reconstruct", "object"):
        state["history"] = [DeclaredArray(10**6, how, np.uint32)]  # the RNG's dtype
        torch.save(state, path)
        with pytest.raises(ValueError, match="refusing|Can only build"):
            load_checkpoint(path)


def test_a_checkpoint_of_the_other_numpy_major_version_resumes(tmp_path):
    """NumPy 1 pickles its RNG array's rebuilding function as numpy.core.multiarray, NumPy 2 as
    numpy._core.multiarray; the weights-only allowlist named only the local one (and under
    NumPy 1.26, whose numpy._core is a stub, failed with AttributeError at every load)."""
    import zipfile

    from kernelstudy.train.checkpoint import load_checkpoint

    trainer = Trainer(_classifier(), ContainsTask(32), _config(steps=4, out_dir=str(tmp_path)))
    trainer.fit(stop_after=2)
    path = tmp_path / "checkpoint.pt"
    names = (b"cnumpy.core.multiarray\n_reconstruct", b"cnumpy._core.multiarray\n_reconstruct")
    with zipfile.ZipFile(path) as source:
        files = {info: source.read(info) for info in source.infolist()}
    ((pickled, data),) = [(i, d) for i, d in files.items() if i.filename.endswith("data.pkl")]
    here, other = names if names[0] in data else names[::-1]
    assert here in data
    files[pickled] = data.replace(here, other)  # as the other NumPy writes it
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as target:
        for info, content in files.items():
            target.writestr(info, content)
    assert isinstance(load_checkpoint(path)["rng"]["numpy"][1], np.ndarray)
    again = Trainer(_classifier(), ContainsTask(32), _config(steps=4, out_dir=str(tmp_path)))
    assert again.fit(resume=True)["steps_completed"] == 4


class _AlwaysPrune:
    def report(self, value: float, step: int) -> None:
        assert math.isfinite(value)

    def should_prune(self) -> bool:
        return True


def test_rows_of_nan_logits_are_wrong_and_never_the_best(tmp_path):
    """argmax of a NaN row is its first NaN's class: a model whose eval outputs were all NaN
    scored the share of class 0 as accuracy (val_loss NaN), and restore_best could keep it
    as the best."""
    nan = torch.full((4, 3), float("nan"))
    label = torch.zeros(4, dtype=torch.long)

    class Constant(nn.Module):
        def __init__(self, out: torch.Tensor) -> None:
            super().__init__()
            self.out = out
            self.weight = nn.Parameter(torch.zeros(()))

        def forward(self, ids, mask=None):
            return self.out + self.weight

    _, stats = Objective("classification")(Constant(nan), {"input_ids": nan, "label": label})
    assert stats["correct"] == 0
    ids = torch.zeros(1, 4, dtype=torch.long)
    lm_batch = {"input_ids": ids, "targets": ids}
    _, stats = Objective("lm")(Constant(torch.full((1, 4, 3), float("nan"))), lm_batch)
    assert stats["correct"] == 0 and stats["seq_correct"] == 0

    # a +inf logit (float16 overflow) makes the row's loss NaN: no prediction either
    inf_row = torch.tensor([[math.inf, 0.0], [0.0, 1.0]])
    _, stats = Objective("classification")(
        Constant(inf_row), {"input_ids": nan, "label": torch.tensor([0, 1])}
    )
    assert stats["correct"] == 1
    # -inf logits (classes a model masks) still predict
    masked = torch.tensor([[0.0, 2.0, -math.inf], [3.0, -math.inf, 1.0]])
    label = torch.tensor([1, 0])
    _, stats = Objective("classification")(Constant(masked), {"input_ids": nan, "label": label})
    assert stats["correct"] == 2
    lm_logits = masked[None].expand(2, 2, 3).reshape(1, 4, 3)
    lm_batch = {"input_ids": ids, "targets": torch.tensor([[1, 0, 1, 0]])}
    _, stats = Objective("lm")(Constant(lm_logits), lm_batch)
    assert stats["correct"] == 4 and stats["seq_correct"] == 1


def test_lm_objective_scores_only_the_loss_mask():
    logits = torch.randn(2, 5, 7)

    class Fixed(nn.Module):
        def forward(self, ids, mask=None):
            return logits

    targets = torch.randint(0, 7, (2, 5))
    loss_mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 1, 0]], dtype=torch.bool)
    targets[1, 3] = logits[1, 3].argmax()
    batch = {"input_ids": targets, "targets": targets, "loss_mask": loss_mask}
    loss, stats = Objective("lm")(Fixed(), batch)
    expected = nn.functional.cross_entropy(logits[loss_mask], targets[loss_mask])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    metrics = Objective.summarize({k: float(v) for k, v in stats.items()})
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-6)
    assert stats["count"] == 3 and stats["seq_count"] == 2
    assert stats["seq_correct"] >= 1  # the second sequence's only scored token is right
    with pytest.raises(ValueError, match="targets"):
        Objective("lm")(Fixed(), {"input_ids": targets})
    # Unscored positions may hold anything (-100, -1); scored ones must be classes.
    padded = targets.masked_fill(~loss_mask, -100)
    same, _ = Objective("lm")(Fixed(), {**batch, "targets": padded})
    assert same.item() == pytest.approx(loss.item(), rel=1e-6)
    for bad, error, match in (
        (padded.masked_fill(loss_mask, -100), ValueError, r"targets must be class indices"),
        (targets + 7, ValueError, r"in \[0, 7\), got values in \["),
        (targets.float(), TypeError, "targets must be an integer tensor"),
    ):
        with pytest.raises(error, match=match):
            Objective("lm")(Fixed(), {**batch, "targets": bad})
    same, _ = Objective("lm")(Fixed(), {**batch, "targets": targets.int()})
    assert same.item() == pytest.approx(loss.item(), rel=1e-6)
    short = loss_mask[:, :-1]  # was a raw IndexError from the boolean indexing
    with pytest.raises(ValueError, match=r"loss_mask must have the targets' shape"):
        Objective("lm")(Fixed(), {**batch, "loss_mask": short})
    no_loss_mask = {k: v for k, v in batch.items() if k != "loss_mask"}
    with pytest.raises(ValueError, match=r"^mask must have the targets' shape"):
        Objective("lm")(Fixed(), {**no_loss_mask, "mask": short})


def test_sequence_accuracy_is_per_scored_sequence():
    """sequence_accuracy = seq_correct / seq_count: two sequences of 5 scored tokens, both
    right, are 1.0 (not divided by the 10 scored tokens: 0.2)."""
    sums = {"loss_sum": 1.0, "count": 10.0, "correct": 10.0, "seq_correct": 2.0, "seq_count": 2.0}
    metrics = Objective.summarize(sums)
    assert metrics["sequence_accuracy"] == 1.0 and metrics["accuracy"] == 1.0
    half = Objective.summarize({**sums, "seq_correct": 1.0, "count": 7.0, "correct": 6.0})
    assert half["sequence_accuracy"] == 0.5


def test_an_lm_batch_with_nothing_scored_has_loss_0_and_finite_gradients():
    """A loss_mask that is all False: the loss is 0 with zero gradients, not 0/0 = NaN
    (which would poison the weights at the next step)."""
    logits = torch.randn(2, 4, 5, requires_grad=True)
    targets = torch.zeros(2, 4, dtype=torch.long)
    batch = {
        "input_ids": targets,
        "targets": targets,
        "loss_mask": torch.zeros(2, 4, dtype=torch.bool),
    }
    loss, stats = Objective("lm")(lambda ids, mask=None: logits, batch)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(logits.grad).all() and not logits.grad.any()
    assert stats["count"] == 0 and stats["seq_count"] == 0


def test_classification_labels_are_checked_before_the_loss():
    """-100 (torch's ignore_index) counted in the accuracy's denominator; a label >= C
    failed inside cross_entropy (a device assert on CUDA)."""

    class Fixed(nn.Module):
        def forward(self, ids, mask=None):
            return torch.zeros(ids.shape[0], 3)

    ids = torch.zeros(2, 4, dtype=torch.long)
    for label, error, match in (
        (torch.tensor([0, -100]), ValueError, r"label must be class indices in \[0, 3\)"),
        (torch.tensor([0, 3]), ValueError, r"got values in \[0, 3\]"),
        (torch.tensor([[0], [1]]), ValueError, r"label must have shape \(batch,\)"),
        (torch.tensor([0.0, 1.0]), TypeError, "label must be an integer tensor"),
        (torch.tensor([False, True]), TypeError, "label must be an integer tensor"),
    ):
        with pytest.raises(error, match=match):
            Objective("classification")(Fixed(), {"input_ids": ids, "label": label})
    # any integer dtype (int32 comes from NumPy) gives int64's loss; cross_entropy takes int64
    want, _ = Objective("classification")(
        Fixed(), {"input_ids": ids, "label": torch.tensor([0, 2])}
    )
    for dtype in (torch.int32, torch.int16, torch.uint8, torch.int8):
        label = torch.tensor([0, 2], dtype=dtype)
        loss, stats = Objective("classification")(Fixed(), {"input_ids": ids, "label": label})
        assert loss.item() == want.item() and stats["count"] == 2


def test_objective_refuses_malformed_batches_by_name():
    """A 0-dim label (one uncollated item) failed with IndexError, a non-tensor value with
    AttributeError, a tuple batch with a RuntimeError from sorting its tensors."""

    class Fixed(nn.Module):
        def forward(self, ids, mask=None):
            return torch.zeros(ids.shape[0], 3)

    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"label must have shape \(batch,\), got \(\)"):
        Objective("classification")(Fixed(), {"input_ids": ids, "label": torch.tensor(2)})
    for batch, key in (
        ({"input_ids": ids, "label": 2}, "label"),
        ({"input_ids": ids, "label": [2]}, "label"),
        ({"input_ids": ids.tolist(), "label": torch.tensor([2])}, "input_ids"),
        ({"input_ids": ids, "mask": [[True] * 4], "label": torch.tensor([2])}, "mask"),
    ):
        with pytest.raises(TypeError, match=rf"batch\['{key}'\] must be a tensor"):
            Objective("classification")(Fixed(), batch)
    lm_batch = {"input_ids": ids, "targets": ids, "loss_mask": [[True] * 4]}
    with pytest.raises(TypeError, match=r"batch\['loss_mask'\] must be a tensor"):
        Objective("lm")(Fixed(), lm_batch)
    with pytest.raises(TypeError, match="batch must be a dict of tensors, got tuple"):
        Objective("classification")(Fixed(), (torch.zeros(4, 6), torch.zeros(4)))


def test_lm_and_matching_tasks_train():
    torch.manual_seed(0)
    copy = CopyTask("train", seq_len=12, n_symbols=4, num_samples=64)
    lm = model_for_task(copy, **SMALL)
    assert isinstance(lm, ks.nn.CausalLM) and lm.positions.max_len == 12
    trainer = Trainer(lm, copy, _config(steps=4), val_data=copy)
    assert trainer.task_type == "lm"
    trainer.fit()
    assert {"val_sequence_accuracy", "train_sequence_accuracy"} <= set(trainer.metrics)

    pairs = PairTask(64)
    matcher = model_for_task(pairs, attention="softmax", **SMALL)
    assert isinstance(matcher, ks.nn.MatchingClassifier)
    trainer = Trainer(matcher, pairs, _config(steps=4), val_data=pairs)
    assert trainer.task_type == "matching"
    assert set(trainer.fit()["final"]) >= {"val_accuracy", "train_loss"}


@pytest.mark.slow
def test_copy_task_reaches_99_percent_token_accuracy():
    """A small linear-attention (elu) LM learns the copy task on CPU (about 10-20 s)."""
    torch.manual_seed(0)
    train = CopyTask("train", seq_len=12, n_symbols=10, num_samples=4000)
    val = CopyTask("val", seq_len=12, n_symbols=10, num_samples=256)
    model = model_for_task(train, d_model=48, n_heads=4, n_layers=2, dropout=0.0, attention="elu")
    cfg = _config(
        steps=500, batch_size=32, lr=5e-3, warmup_steps=50, eval_every=125, eval_batch_size=256
    )
    record = Trainer(model, train, cfg, val_data=val).fit()
    assert record["best"]["value"] >= 0.99  # token accuracy on the copied half


@pytest.mark.slow
def test_listops_subset_trains_above_the_majority_baseline(tmp_path):
    """Short ListOps (20-60 tokens, depth <= 3, 3000 examples): a small linear-attention (elu)
    classifier beats always answering the most common value (about 30 s on one CPU thread)."""
    write_listops(tmp_path, 3000, 300, 300, min_length=20, max_length=60, seed=0, max_depth=3)
    train, val, test = (ListOpsTask(tmp_path, s, max_length=60) for s in ("train", "val", "test"))
    majority = max(torch.bincount(torch.as_tensor(test.labels)).tolist()) / len(test)
    torch.manual_seed(0)
    model = model_for_task(train, d_model=32, n_heads=4, n_layers=2, dropout=0.0, attention="elu")
    cfg = _config(steps=200, batch_size=32, lr=3e-3, warmup_steps=20, eval_every=50)
    record = Trainer(model, train, cfg, val_data=val, test_data=test).fit()
    assert majority < 0.25
    assert record["test"]["accuracy"] > majority + 0.08, (record["test"], majority)


def test_schedules():
    w = WarmupDecay("cosine", warmup_steps=4, total_steps=14)
    assert [w(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert w(9) == pytest.approx(0.5) and w(14) == pytest.approx(0.0)
    lin = WarmupDecay("linear", 0, 10, min_ratio=0.1)
    assert lin(0) == 1.0 and lin(5) == pytest.approx(0.55) and lin(10) == pytest.approx(0.1)
    inv = WarmupDecay("inverse_sqrt", 4, 100)
    assert inv(3) == 1.0 and inv(15) == pytest.approx(0.5)
    assert WarmupDecay("constant", 0, 5)(4) == 1.0
    with pytest.raises(ValueError, match="schedule"):
        WarmupDecay("step", 0, 5)
    # bools passed as counts, a string min_ratio (a TypeError from `<=`), and the message
    # named min_lr_ratio (TrainConfig's field), not this argument
    for kwargs, error, match in (
        ({"warmup_steps": True}, ValueError, "warmup_steps must be an int"),
        ({"total_steps": True}, ValueError, "total_steps must be an int"),
        ({"min_ratio": "0.1"}, TypeError, "min_ratio must be a float"),
        ({"min_ratio": True}, TypeError, "min_ratio must be a float"),
        ({"min_ratio": 1.5}, ValueError, r"^min_ratio must be in \[0, 1\]"),
    ):
        with pytest.raises(error, match=match):
            WarmupDecay(**{"schedule": "linear", "warmup_steps": 0, "total_steps": 5, **kwargs})
    trainer = Trainer(
        _classifier(), ContainsTask(32), _config(steps=8, eval_every=1, warmup_steps=4)
    )
    trainer.fit()
    lrs = trainer.metrics["lr"].tolist()
    assert lrs[:4] == pytest.approx([3e-3 * f for f in (0.25, 0.5, 0.75, 1.0)])
    assert lrs[4:] == sorted(lrs[4:], reverse=True)


def test_numpy_numbers_are_taken_and_kept_as_plain_floats():
    """numpy ints were taken and np.float64 (a float subclass), but an np.float32 lr was "not a
    number >= 0"; the config keeps plain floats (its JSON record)."""
    cfg = TrainConfig(
        lr=np.float32(1e-3),
        weight_decay=np.float32(0.01),
        reg_weight=np.float16(0.5),
        min_lr_ratio=np.float32(0.0),
        clip_norm=np.float32(1.0),
        betas=(np.float32(0.9), 0.999),
    )
    values = [cfg.lr, cfg.weight_decay, cfg.reg_weight, cfg.min_lr_ratio, cfg.clip_norm]
    assert all(type(x) is float for x in [*values, *cfg.betas])
    assert cfg.lr == pytest.approx(1e-3) and cfg.betas[0] == pytest.approx(0.9)
    assert TrainConfig(clip_norm=np.float32(0.0)).clip_norm is None  # 0: clipping off
    with pytest.raises(ValueError, match="lr must be a number >= 0"):
        TrainConfig(lr=np.bool_(True))


def test_bad_configuration_fails_before_training():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=-1.0)
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig(schedule="exponential")
    for clip_norm in (-1.0, True, "off"):
        with pytest.raises(ValueError, match="clip_norm must be > 0, or None, 0 or 'none'"):
            TrainConfig(clip_norm=clip_norm)
    with pytest.raises(ValueError, match="seed must be < 2"):
        TrainConfig(seed=2**63)
    for flag in ("amp", "compile", "progress", "restore_best"):  # "false" read as True
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            TrainConfig(**{flag: "false"})
    # the largest seed trains (its epochs' data-order seeds overflowed torch's 64 bits)
    big = Trainer(_classifier(), ContainsTask(32), _config(steps=3, seed=2**63 - 1))
    assert big.fit()["steps_completed"] == 3
    # test_data and callbacks are checked when the Trainer is built, not after training
    empty = torch.utils.data.Subset(ContainsTask(8), [])
    with pytest.raises(ValueError, match="test_data is empty"):
        Trainer(_classifier(), ContainsTask(8), _config(), test_data=empty)
    with pytest.raises(TypeError, match="test_data must be a torch Dataset"):
        Trainer(_classifier(), ContainsTask(8), _config(), test_data=[1, 2])
    with pytest.raises(TypeError, match="on_eval must be a callable"):
        Trainer(_classifier(), ContainsTask(8), _config(), on_eval=5)
    with pytest.raises(ValueError, match="task_type"):
        TrainConfig(task_type="regression")
    with pytest.raises(ValueError, match="unknown TrainConfig"):
        TrainConfig.from_dict({"stepz": 3})
    assert TrainConfig.from_dict(_config().to_dict()) == _config()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            Trainer(_classifier(), ContainsTask(8), _config(device="cuda"))
    if not torch.backends.mps.is_available():  # was a RuntimeError traceback from torch
        with pytest.raises(ValueError, match="device='mps' is not usable here: "):
            Trainer(_classifier(), ContainsTask(8), _config(device="mps"))
    with pytest.raises(ValueError, match="out_dir"):
        Trainer(_classifier(), ContainsTask(8), _config()).fit(resume=True)
    with pytest.raises(TypeError, match="train_data"):
        Trainer(_classifier(), [1, 2, 3], _config())
    for betas in (3, (0.9,), ("a", "b"), (0.9, 1.0), (True, 0.9)):
        with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\)"):
            TrainConfig(betas=betas)
    assert TrainConfig(betas=[0.8, 0.9]).betas == (0.8, 0.9)
    with pytest.raises(ValueError, match="monitor must be a metrics column.*'val_f1'"):
        TrainConfig(monitor="val_f1")  # not even a Trainer: a typo fails with the config
    # A column this run will not have fails when the Trainer is built, not after training.
    no_fit = _config(monitor="val_sequence_accuracy")  # an LM metric, a classifier's run
    with pytest.raises(ValueError, match="monitor 'val_sequence_accuracy' is not a metric"):
        Trainer(_classifier(), ContainsTask(8), no_fit, val_data=ContainsTask(8))
    with pytest.raises(ValueError, match="monitor 'grad_norm' is not a metric"):
        Trainer(_classifier(), ContainsTask(8), _config(monitor="grad_norm", clip_norm=None))
    for lower_is_better in ("val_loss", "train_loss", "train_reg"):  # the penalty too
        with pytest.raises(ValueError, match=f"'{lower_is_better}' improves as it falls.*'min'"):
            TrainConfig(monitor=lower_is_better)  # mode defaults to max: kept the worst
    assert TrainConfig(monitor="val_loss", mode="min").mode == "min"


def test_steps_the_float16_scaler_skips_leave_the_gradient_norm_finite(tmp_path, monkeypatch):
    """Dynamic loss scaling overflows on purpose now and then; the skipped step's inf norm
    made the window's reported grad_norm inf. The window reports the mean norm of the steps
    the scaler applied. A non-checkpoint file is refused by name."""
    task = CopyTask("train", seq_len=16, n_symbols=4, num_samples=24)
    torch.manual_seed(0)
    lm = ks.nn.CausalLM(6, d_model=16, n_heads=2, n_layers=1, max_len=16)
    cfg = _config(steps=8, batch_size=6, eval_every=4, monitor="train_loss", mode="min")
    trainer = Trainer(lm, task, cfg)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # as float16 AMP
    seen, clip = [], torch.nn.utils.clip_grad_norm_

    def recording(*args, **kwargs):
        norm = clip(*args, **kwargs)
        seen.append(float(norm))
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    calls = [0]

    def overflow_once(grad):
        calls[0] += 1
        return grad * math.inf if calls[0] == 2 else grad

    lm.head.bias.register_hook(overflow_once)
    trainer.fit()
    norms = trainer.metrics["grad_norm"].tolist()
    assert len(norms) == 2 and all(math.isfinite(n) and n > 0 for n in norms)
    first = [n for n in seen[:4] if math.isfinite(n)]  # the first window: one step skipped
    assert len(first) == 3 and norms[0] == pytest.approx(sum(first) / 3, rel=1e-5)
    assert trainer.scaler.get_scale() == 2.0**9  # the overflow was seen and skipped
    weights = tmp_path / "model.pt"
    torch.save(lm.state_dict(), weights)
    with pytest.raises(ValueError, match="model.pt is not a Trainer checkpoint: it lacks config"):
        trainer.load_checkpoint(weights)


def test_a_non_finite_gradient_stops_before_the_weights_change(tmp_path):
    """A finite loss with an infinite gradient (sqrt at 0) used to be applied: clipping
    turned it into NaN weights, the evaluation at that step wrote NaN metrics and a NaN
    checkpoint, and only the next step raised, so a resume reloaded the poisoned weights."""

    class Sqrt(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(8, 2)
            self.w = nn.Parameter(torch.zeros(()))

        def forward(self, ids, mask=None):
            return self.emb(ids).mean(1) + torch.sqrt(self.w.abs())

    for clip_norm in (1.0, None):
        model = Sqrt()
        before = _params(model)
        out = tmp_path / f"clip_{clip_norm}"
        cfg = _config(steps=4, eval_every=1, clip_norm=clip_norm, out_dir=str(out))
        with pytest.raises(FloatingPointError, match="non-finite gradient .* at step 1"):
            Trainer(model, ContainsTask(32), cfg, val_data=ContainsTask(16)).fit()
        after = _params(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert not (out / "checkpoint.pt").exists()


def test_a_checkpoint_without_float16_scaling_resumes_with_it(tmp_path):
    """A run saved without float16 AMP (its grad scaler disabled: empty state) and resumed
    where float16 AMP is on (a GPU) failed: an enabled GradScaler refuses an empty state."""
    cfg = _config(steps=4, eval_every=2, out_dir=str(tmp_path))
    first = Trainer(_classifier(), ContainsTask(32), cfg)
    first.fit(stop_after=2)
    again = Trainer(_classifier(), ContainsTask(32), cfg)
    again.scaler = torch.amp.GradScaler("cpu", enabled=True)  # as float16 AMP on a GPU
    again.load_checkpoint(tmp_path / "checkpoint.pt")
    assert again.step == 2 and again.scaler.is_enabled()


def test_eval_batch_size_is_resume_free_only_without_eval_batches():
    """With ``eval_batches`` capping the evaluation, the batch size picks which examples
    are scored, so changing it at a resume is a change (None reads as ``batch_size``)."""
    base = TrainConfig(batch_size=8).to_dict()
    assert resume_changes(base, {**base, "eval_batch_size": 64, "device": "cpu"}) == []
    capped = {**base, "eval_batches": 2}
    assert resume_changes(capped, {**capped, "eval_batch_size": 64}) == ["eval_batch_size"]
    assert resume_changes(capped, {**capped, "eval_batch_size": 8}) == []
    assert resume_changes(base, {**capped, "eval_batch_size": 64}) == [
        "eval_batch_size",
        "eval_batches",
    ]
    assert resume_changes(base, {**base, "lr": 0.5}) == ["lr"]
    # a field the checkpoint's config lacks (saved before it existed) had its default
    older = {k: v for k, v in base.items() if k != "compile"}
    assert resume_changes(older, base) == []
    assert resume_changes(older, {**base, "compile": True}) == ["compile"]


def test_fit_removes_the_temp_files_of_a_save_that_was_killed(tmp_path):
    """A kill inside ``torch.save`` left ``.checkpoint.pt.<hex>.tmp`` (weights and Adam state)
    for good: a resumed or new run in the folder removes it; a file of another name stays."""
    out = tmp_path / "run"
    out.mkdir()
    killed = out / ".checkpoint.pt.0123456789abcdef.tmp"
    killed.write_bytes(b"half a checkpoint")
    other = out / ".notes.0123456789abcdef.tmp"
    other.write_text("not ours")
    trainer = Trainer(_classifier(), ContainsTask(32), _config(steps=2, out_dir=str(out)))
    trainer.fit(resume=True)
    assert not killed.exists() and other.exists()
    assert (out / "checkpoint.pt").is_file()


class SortedByLabel(Dataset):
    """A validation split sorted by label, as IMDB's is read (``neg/`` then ``pos/``)."""

    def __init__(self, size: int) -> None:
        self.label = (torch.arange(size) >= size // 2).long()

    def __len__(self) -> int:
        return len(self.label)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.zeros(4, dtype=torch.long), "label": self.label[i]}


class AlwaysZero(nn.Module):
    """A classifier that answers class 0 whatever it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, mask=None):
        return torch.tensor([5.0, 0.0]).expand(len(input_ids), 2) + 0 * self.w


def test_eval_batches_score_a_sample_not_the_first_batches_of_a_sorted_split():
    """``eval_batches`` scored the first batches in file order: on a split sorted by label
    (IMDB's) a model always answering the first class scored 1.0. They are now a fixed random
    sample: about half of them the other class, the same at every evaluation."""
    val = SortedByLabel(400)
    trainer = Trainer(AlwaysZero(), val, _config(batch_size=16, eval_batches=8), val_data=val)
    first = trainer.evaluate(trainer.val_loader, 8)
    assert 0.35 < first["accuracy"] < 0.65
    assert trainer.evaluate(trainer.val_loader, 8) == first  # the same sample every time
    assert trainer.evaluate(val, 8) == first  # also given the Dataset
    assert trainer.evaluate(val)["accuracy"] == 0.5  # the whole split, in order
    ordered = DataLoader(val, batch_size=16)  # a DataLoader of the caller's: its own order
    assert trainer.evaluate(ordered, 8)["accuracy"] == 1.0


def test_eval_batches_score_one_sample_whatever_the_runs_seed():
    """The sample was drawn from the run's training seed: an evaluation's seeds 1..n were each
    scored on other examples (two runs of 8 batches of 16 shared 8 of their 128), and its
    best run by validation accuracy was mostly the luckiest sample."""
    val = ContainsTask(400)
    scored = []
    for seed in (0, 1, 2):
        trainer = Trainer(AlwaysZero(), val, _config(batch_size=16, eval_batches=8, seed=seed),
                          val_data=val)  # fmt: skip
        scored.append(torch.cat([b["input_ids"] for b in trainer.val_loader][:8]))
    assert len(scored[0]) == 128 and all(torch.equal(scored[0], s) for s in scored[1:])


def test_ctrl_c_saves_the_step_it_ends_and_the_run_resumes_exactly(tmp_path, monkeypatch):
    """A Ctrl-C used to lose every step since the last evaluation (no checkpoint there);
    it now takes effect at the end of its step, with a checkpoint saved at that step."""
    cfg = {"steps": 12, "eval_every": 10, "schedule": "linear"}
    torch.manual_seed(0)
    straight = Trainer(_classifier(dropout=0.2), ContainsTask(64), _config(**cfg))
    straight.fit()

    out = tmp_path / "run"
    torch.manual_seed(0)
    first = Trainer(_classifier(dropout=0.2), ContainsTask(64), _config(out_dir=str(out), **cfg))
    real = first._train_step

    def interrupted_in_step_5():
        if first.step == 4:  # the signal arrives in the middle of step 5
            os.kill(os.getpid(), signal.SIGINT)
        return real()

    monkeypatch.setattr(first, "_train_step", interrupted_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "interrupted" and record["steps_completed"] == 5
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    again = Trainer(_classifier(dropout=0.2), ContainsTask(64), _config(out_dir=str(out), **cfg))
    again.fit(resume=True)
    a, b = _params(straight.model), _params(again.model)
    assert again.step == 12 and all(torch.equal(a[k], b[k]) for k in a)


def test_a_ctrl_c_after_the_last_steps_check_is_not_lost(tmp_path, monkeypatch):
    """A Ctrl-C that arrived after the last step's check, while the loop was being left,
    only set the request: the test evaluation then ran and the run reported completed."""
    import kernelstudy.train.trainer as trainer_module

    class LateInterrupt(DeferredInterrupt):
        def __exit__(self, *exc):
            self._handle(signal.SIGINT, None)  # the signal lands as the loop is left
            return super().__exit__(*exc)

    monkeypatch.setattr(trainer_module, "DeferredInterrupt", LateInterrupt)
    out = tmp_path / "run"
    trainer = Trainer(
        _classifier(),
        ContainsTask(32),
        _config(steps=3, eval_every=3, out_dir=str(out)),
        test_data=ContainsTask(16),
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "interrupted" and record["steps_completed"] == 3
    assert record["test"] is None and trainer.test_metrics is None
    monkeypatch.undo()
    again = Trainer(
        _classifier(),
        ContainsTask(32),
        _config(steps=3, eval_every=3, out_dir=str(out)),
        test_data=ContainsTask(16),
    )
    assert again.fit(resume=True)["status"] == "completed"


def test_a_sigterm_ends_the_run_after_its_step_with_the_checkpoint_saved(tmp_path):
    """SIGTERM (timeout, a scheduler, kill) ended training at once: every step since the last
    evaluation was lost and run.json described the session before. It is deferred to the end
    of its step as Ctrl-C is; the process then ends by SIGTERM, as it would have."""
    import subprocess
    import sys

    out = tmp_path / "run"
    child = f"""
import os, signal
from kernelstudy.train import Trainer
from tests.test_trainer import ContainsTask, _classifier, _config

config = _config(steps=12, eval_every=10, out_dir={str(out)!r})
trainer = Trainer(_classifier(), ContainsTask(64), config)
real = trainer._train_step

def terminated_in_step_5():
    if trainer.step == 4:
        os.kill(os.getpid(), signal.SIGTERM)
    return real()

trainer._train_step = terminated_in_step_5
trainer.fit()
print("not reached")
"""
    repo = tmp_path.__class__(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", child], cwd=repo, env=env, capture_output=True, text=True
    )
    assert run.returncode == -signal.SIGTERM, run.stderr[-2000:]
    assert "not reached" not in run.stdout
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "interrupted" and record["steps_completed"] == 5
    from kernelstudy.train.checkpoint import load_checkpoint

    assert load_checkpoint(out / "checkpoint.pt")["step"] == 5


def test_a_second_ctrl_c_interrupts_at_once():
    with DeferredInterrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.requested and not interrupt.terminated
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_checkpoint_from_before_the_grad_norm_count_resumes_with_the_right_mean(tmp_path):
    """Sums saved without ``grad_norm_count`` (older checkpoints) counted every step."""
    from kernelstudy.train.checkpoint import load_checkpoint, save_checkpoint

    cfg = _config(steps=10, eval_every=10, out_dir=str(tmp_path))
    torch.manual_seed(0)
    straight = Trainer(_classifier(), ContainsTask(64), _config(steps=10, eval_every=10))
    straight.fit()
    torch.manual_seed(0)
    Trainer(_classifier(), ContainsTask(64), cfg).fit(stop_after=5)
    path = tmp_path / "checkpoint.pt"
    state = load_checkpoint(path)
    state["sums"].pop("grad_norm_count")  # as an older checkpoint holds them
    save_checkpoint(path, state)
    again = Trainer(_classifier(), ContainsTask(64), cfg)
    again.fit(resume=True)
    want = straight.metrics["grad_norm"].iloc[-1]
    assert again.metrics["grad_norm"].iloc[-1] == pytest.approx(want, rel=1e-6)


_CTRL_C_WITH_LOADER_WORKERS = """
import sys, time
from pathlib import Path
from tests.test_trainer import ContainsTask, _classifier, _config
from kernelstudy.train import Trainer

out = Path(sys.argv[1])

class Slow(ContainsTask):  # loading is the bottleneck: the signal finds workers busy
    def __getitem__(self, i):
        if not (out / "fetching").exists():
            (out / "fetching").touch()
        time.sleep(0.02)
        return super().__getitem__(i)

import torch

torch.set_num_threads(1)  # as the one_thread fixture: bit-identical sums
cfg = _config(steps=150, eval_every=150, num_workers=2, out_dir=str(out))
resumed = sys.argv[2] == "resumed"
if resumed:  # paused mid-epoch: the resume makes the workers before the signals are deferred
    torch.manual_seed(0)
    Trainer(_classifier(), ContainsTask(640), cfg).fit(stop_after=3)
torch.manual_seed(0)
Trainer(_classifier(), Slow(640), cfg).fit(resume=resumed)  # 40 batches an epoch
"""


@pytest.mark.parametrize(
    "signum, resumed",
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["ctrl_c", "timeout", "ctrl_c_after_a_resume"],
)
def test_a_signal_to_the_process_group_with_loader_workers_still_checkpoints(
    tmp_path, signum, resumed
):
    """A terminal's Ctrl-C and ``timeout``'s SIGTERM reach the whole process group: the
    DataLoader's workers died of them (Ctrl-C survived only in workers forked after the
    signals were deferred, not on a resumed run), and the run failed with "DataLoader
    worker exited unexpectedly", its steps since the last checkpoint lost. The workers
    stand apart (own group, SIGINT ignored); the training process ends its step, saves
    it, and the run resumes to the same weights."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    out = tmp_path / "run"
    out.mkdir()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", _CTRL_C_WITH_LOADER_WORKERS, str(out), str(resumed and "resumed")],
        cwd=root,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (out / "fetching").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "the run never started loading"
        time.sleep(0.05)
    time.sleep(1.0)  # some steps in
    os.killpg(proc.pid, signum)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == -signum, log[-2000:]  # ended by the signal, after its step
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "interrupted", log[-2000:]
    assert 3 < record["steps_completed"] < 150 and (out / "checkpoint.pt").is_file()

    cfg = {"steps": 150, "eval_every": 150}
    torch.manual_seed(0)
    straight = Trainer(_classifier(), ContainsTask(640), _config(**cfg))
    straight.fit()
    again = Trainer(_classifier(), ContainsTask(640), _config(out_dir=str(out), **cfg))
    again.fit(resume=True)
    a, b = _params(straight.model), _params(again.model)
    assert again.step == cfg["steps"] and all(torch.equal(a[k], b[k]) for k in a)


def test_a_loader_of_ones_own_with_persistent_workers_resumes_exactly(tmp_path):
    """Persistent workers draw their base seed from the loader's generator at the first
    epoch's iter() only; a resume in a later epoch made a new iterator, which drew it
    again, and the epoch's order was another."""

    def fit(**kw):
        data = ContainsTask(64)
        loader = DataLoader(
            data,
            batch_size=16,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(5),
        )
        torch.manual_seed(0)
        trainer = Trainer(_classifier(), loader, _config(steps=10, eval_every=10, **kw.pop("cfg")))
        trainer.fit(**kw)
        return trainer

    straight = fit(cfg={})
    fit(cfg={"out_dir": str(tmp_path)}, stop_after=6)  # in the second epoch (4 batches each)
    again = fit(cfg={"out_dir": str(tmp_path)}, resume=True)
    a, b = _params(straight.model), _params(again.model)
    assert again.step == 10 and all(torch.equal(a[k], b[k]) for k in a)


class _TwoTowers(nn.Module):
    """A custom model whose layers use maps of two feature dims (elu: 8, FAVOR+: 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _classifier()
        self.b = _classifier("favor", feature_map_kwargs={"num_features": 16})

    def forward(self, ids, mask=None):
        return self.a(ids, mask) + self.b(ids, mask)


def test_a_model_with_maps_of_several_feature_dims_records_them_all(tmp_path):
    """The run record called feature_dim_of, which raised after the whole run trained."""
    trainer = Trainer(_TwoTowers(), ContainsTask(32), _config(steps=2, out_dir=str(tmp_path)))
    assert trainer.fit()["status"] == "completed"
    assert json.loads((tmp_path / "run.json").read_text())["feature_dim"] == [8, 16]
    softmax = Trainer(_classifier("softmax"), ContainsTask(32), _config(steps=1)).fit()
    assert softmax["feature_dim"] is None


def test_extending_a_finished_run_rescoring_the_test_set_from_the_last_weights(tmp_path):
    """A finished run resumed with more steps went on from the restored best weights (the
    checkpoint held them, with the last step's optimizer moments) and kept the test
    metrics of the first finish."""
    train, val = ContainsTask(64), ContainsTask(32, seed=1)
    cfg = {"eval_every": 3, "lr": 3e-2, "schedule": "constant", "monitor": "val_loss"}
    cfg.update(mode="min", out_dir=str(tmp_path))

    def build(steps):
        torch.manual_seed(0)
        model = _classifier(dropout=0.1)
        return Trainer(model, train, _config(steps=steps, **cfg), val_data=val, test_data=val)

    first = build(9)
    last_step = {}
    finish = first._finish
    first._finish = lambda: (last_step or last_step.update(_params(first.model)), finish())
    record = first.fit()
    assert record["best"]["step"] < 9  # so the best and the last weights differ
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(saved[k], last_step[k]) for k in last_step)
    for again in (first.fit, first.save_checkpoint):  # the model holds the best weights now
        again()
        saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["model"]
        assert all(torch.equal(saved[k], last_step[k]) for k in last_step), again
    best = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(best[k], first.best_state[k]) for k in best)

    longer = build(15)
    with pytest.warns(UserWarning, match=r"changed config field\(s\) \['steps'\]"):
        extended = longer.fit(resume=True)
    assert extended["status"] == "completed" and extended["steps_completed"] == 15
    assert extended["test"] == longer.evaluate(val)  # the final model's, not step 9's
    assert extended["test"] != record["test"]
    # it went on from the last step's weights: its last weights are a straight run's
    extended_last = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["model"]
    cfg["out_dir"] = str(tmp_path / "straight")
    build(15).fit()
    straight_last = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    assert all(torch.equal(extended_last[k], v) for k, v in straight_last["model"].items())


def test_an_lr_beyond_float32_is_refused_by_name():
    """lr = 1e300 passed the checks and crashed inside Adam ("value cannot be converted to
    type float without overflow"), after the run's files were written."""
    from kernelstudy.train import TrainConfig

    for name in ("lr", "weight_decay", "reg_weight"):
        with pytest.raises(ValueError, match=rf"{name} must be at most 3.403e\+38, got 1e\+300"):
            TrainConfig(**{name: 1e300})


def test_resume_refuses_a_changed_lr_weight_decay_or_betas(tmp_path):
    """The optimizer and schedule state restored the saved values: the change was ignored
    while run.json recorded it."""
    cfg = {"steps": 8, "schedule": "constant", "out_dir": str(tmp_path)}
    Trainer(_classifier(), ContainsTask(32), _config(**cfg)).fit(stop_after=4)
    changes = ({"lr": 1e-2}, {"weight_decay": 0.5}, {"betas": (0.8, 0.99)})
    for change in changes:
        trainer = Trainer(_classifier(), ContainsTask(32), _config(**cfg, **change))
        with pytest.raises(ValueError, match=f"cannot resume .* with changed {next(iter(change))}"):
            trainer.fit(resume=True)
    with pytest.raises(ValueError, match="changed lr, weight_decay"):
        Trainer(_classifier(), ContainsTask(32), _config(**cfg, **changes[0], **changes[1])).fit(
            resume=True
        )
    # other changes still resume, with a warning
    with pytest.warns(UserWarning, match=r"changed config field\(s\) \['seed'\]"):
        record = Trainer(_classifier(), ContainsTask(32), _config(**cfg, seed=1)).fit(resume=True)
    assert record["steps_completed"] == 8


def test_clip_norm_0_or_none_turns_clipping_off():
    """TOML has no null: clipping could not be turned off from a config file or the CLI."""
    for off in (0, 0.0, "none", "None", None):
        assert TrainConfig(clip_norm=off).clip_norm is None
    assert TrainConfig.from_dict({"clip_norm": "none"}).to_dict()["clip_norm"] is None
    record = Trainer(_classifier(), ContainsTask(32), _config(steps=4, clip_norm=0)).fit()
    assert "grad_norm" not in record["final"]


def test_patience_on_a_training_metric_needs_no_val_data():
    cfg = _config(steps=40, eval_every=2, lr=1e-9, patience=2, monitor="train_loss", mode="min")
    record = Trainer(_classifier(), ContainsTask(32), cfg).fit()
    assert record["status"] == "early_stopped" and record["steps_completed"] < 40
    with pytest.raises(ValueError, match="patience .* on monitor 'val_loss' needs val_data"):
        Trainer(
            _classifier(), ContainsTask(32), _config(patience=2, monitor="val_loss", mode="min")
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1, got 0"),
        ({"batch_size": 2.5}, ValueError, "batch_size must be an int >= 1"),
        ({"batch_size": True}, ValueError, "batch_size must be an int >= 1, got True"),
        ({"batch_size": "4"}, ValueError, "batch_size must be an int >= 1"),
        ({"seed": -1}, ValueError, "seed must be an int >= 0"),
        ({"seed": 2**70}, ValueError, "seed must be an int <= 9223372036854775807"),
        ({"seed": 1.5}, ValueError, "seed must be an int"),
        ({"shuffle": "no"}, TypeError, "shuffle must be a bool"),
        ({"num_workers": -1}, ValueError, "num_workers must be an int >= 0"),
    ],
)
def test_make_loader_names_a_bad_argument(kwargs, error, match):
    """The public make_loader failed deep inside (ZeroDivisionError for batch_size 0, an
    overflow for a huge seed) or took True as batch size 1."""
    from kernelstudy.train import make_loader

    with pytest.raises(error, match=match):
        make_loader(ContainsTask(8), **{"batch_size": 4, **kwargs})


def test_epoch_batch_sampler_names_a_bad_argument():
    from kernelstudy.train.data import EpochBatchSampler

    with pytest.raises(ValueError, match="the training data is empty"):
        EpochBatchSampler(0, 4, 0)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        EpochBatchSampler(8, 0, 0)
    with pytest.raises(ValueError, match="size must be an int >= 1, got -2"):
        EpochBatchSampler(-2, 4, 0)
    assert len(EpochBatchSampler(8, 3, 0)) == 2  # drop_last: 2 full batches


def test_epoch_orders_of_different_seeds_do_not_coincide():
    """The data order of (seed, epoch) is its own: seed 1's epoch 0 is not seed 0's epoch 1
    (an epoch seed of seed + epoch would give runs of seeds 0 and 1 the same orders shifted)."""
    from kernelstudy.train.data import EpochBatchSampler

    def order(seed: int, epoch: int) -> list[int]:
        sampler = EpochBatchSampler(20, 5, seed)
        sampler.epoch = epoch
        return [i for batch in sampler for i in batch]

    assert order(0, 1) == order(0, 1)  # a pure function of (seed, epoch)
    for epoch in range(3):
        assert order(1, epoch) != order(0, epoch + 1)
        assert order(2, epoch) != order(1, epoch + 1)


def test_batch_stream_shuffles_each_epoch_anew():
    """The stream moves on to epoch 1 after epoch 0's batches, with a new order (not epoch 0's
    order repeated for ever)."""
    from kernelstudy.train import make_loader
    from kernelstudy.train.data import BatchStream

    stream = BatchStream(make_loader(ContainsTask(8), 4, seed=0))

    def epoch() -> list[list[int]]:
        return [next(stream)["input_ids"].tolist() for _ in range(2)]

    first, second = epoch(), epoch()
    assert stream.state_dict()["epoch"] == 1 and stream.state_dict()["batch"] == 2
    assert sorted(sum(first, [])) == sorted(sum(second, []))  # the same 8 examples
    assert first != second


def test_cuda_generators_resume_on_the_training_device(monkeypatch):
    """Every visible GPU's state was restored by index: IndexError on a machine with fewer
    GPUs, and a run moved from cuda:1 to cuda:0 drew on from cuda:0's old stream."""
    from kernelstudy.train import checkpoint

    states = {0: torch.tensor([0], dtype=torch.uint8), 1: torch.tensor([1], dtype=torch.uint8)}
    restored = {}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [states[0], states[1]])
    monkeypatch.setattr(cuda, "get_rng_state", lambda device: states[torch.device(device).index])
    monkeypatch.setattr(
        cuda,
        "set_rng_state",
        lambda s, device: restored.update(
            {torch.device("cuda", device) if isinstance(device, int) else device: s}
        ),
    )
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    saved = checkpoint.get_rng_state(torch.device("cuda:1"))
    assert saved["cuda_device"] is states[1]
    checkpoint.set_rng_state(saved, torch.device("cuda:0"))  # one GPU here
    assert restored == {torch.device("cuda:0"): states[1]}
    restored.clear()
    del saved["cuda_device"]  # a checkpoint from before: each GPU by index, those that exist
    checkpoint.set_rng_state(saved)
    assert restored == {torch.device("cuda:0"): states[0]}


def test_seeds_and_rng_states_are_checked_by_name():
    """seed_everything(1.5) failed in numpy ("Cannot cast scalar"), 2**64 in torch
    ("Overflow when unpacking long"), -1 was taken (as TrainConfig refuses them); and
    set_rng_state({}) was a bare KeyError 'python'."""
    from kernelstudy.train import checkpoint

    checkpoint.seed_everything(2**63 - 1)
    for seed in (1.5, 2**63, -1, True):
        with pytest.raises(ValueError, match=r"seed must be an int (>= 0|<= 9223372036854775807)"):
            checkpoint.seed_everything(seed)
    with pytest.raises(ValueError, match=r"missing keys \['python', 'numpy', 'torch'\]"):
        checkpoint.set_rng_state({"x": 1})
    with pytest.raises(TypeError, match="state must be a dict of get_rng_state"):
        checkpoint.set_rng_state(None)


class _Stream(torch.utils.data.IterableDataset):
    """ContainsTask's items as an IterableDataset (its DataLoader has no generator)."""

    def __init__(self, task: ContainsTask) -> None:
        self.task = task

    def __iter__(self):
        return (self.task[i] for i in range(len(self.task)))


@pytest.mark.parametrize("kind", ["loader", "iterable"])
def test_evaluating_does_not_change_the_training(kind):
    """A val DataLoader without its own generator (passed in, or made over an
    IterableDataset) took its seed from torch's global generator at every evaluation:
    training then drew other dropout masks, and eval_every changed the trained model
    (final val accuracy 0.475 with eval_every=1, 0.70 with 0)."""
    val_task = ContainsTask(40, seed=1)

    def run(eval_every):
        val = DataLoader(val_task, batch_size=8) if kind == "loader" else _Stream(val_task)
        torch.manual_seed(0)
        model = _classifier(dropout=0.3)
        cfg = _config(eval_every=eval_every, restore_best=False)
        trainer = Trainer(model, ContainsTask(64), cfg, val_data=val)
        trainer.fit()
        return _params(model), trainer.metrics.iloc[-1]

    (often, last_often), (once, last_once) = run(1), run(0)
    assert all(torch.equal(often[k], once[k]) for k in often)
    assert last_often["val_loss"] == last_once["val_loss"]


def _decayed_parameters(model: nn.Module) -> tuple[Trainer, set[str]]:
    """A Trainer of ``model`` with weight decay 0.1, and the names of the parameters its
    optimizer decays."""
    trainer = Trainer(model, ContainsTask(16), _config(weight_decay=0.1))
    name_of = {id(p): n for n, p in model.named_parameters()}
    decayed = {
        name_of[id(p)]
        for group in trainer.optimizer.param_groups
        if group["weight_decay"] > 0
        for p in group["params"]
    }
    return trainer, decayed


def test_weight_decay_spares_biases_of_any_shape_and_norms():
    """Hedgehog's per-head bias (H, 1, D) is 3-d: the shape rule (decay when dim >= 2)
    decayed it, against the stated convention (no decay on biases and norms)."""
    model = _classifier(attention="hedgehog")
    trainer, decayed = _decayed_parameters(model)
    names = {n for n, _ in model.named_parameters()}
    kept = names - decayed
    biases = {n for n in names if n.endswith("bias")}
    assert any(model.get_parameter(n).dim() == 3 for n in biases)  # the map's bias
    assert biases <= kept and not any(".norm" in n for n in decayed)
    assert {"embed.weight", "head.0.weight"} <= decayed
    assert any(n.endswith("feature_map.weight") for n in decayed)
    # every parameter in exactly one group, in model.parameters() order (as before)
    order = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert sorted(map(id, order)) == sorted(map(id, model.parameters()))


class _SlowTask(ContainsTask):
    """Items that take 4 ms each: a Dataset only evaluated, whose cost shows in the time."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(0.004)
        return super().__getitem__(i)


def test_the_training_time_leaves_out_evaluation(tmp_path):
    """wall_time_s counts evaluations, test scoring and checkpoints (what the search's
    figures labelled training time); train_time_s the training steps alone, summed over a
    pause and resume."""
    val, test = _SlowTask(100, seed=1), _SlowTask(100, seed=2)  # >= 0.4 s a scoring
    cfg = _config(steps=8, eval_every=2, out_dir=str(tmp_path))
    first = Trainer(_classifier(), ContainsTask(64), cfg, val_data=val, test_data=test)
    paused = first.fit(stop_after=4)
    second = Trainer(_classifier(), ContainsTask(64), cfg, val_data=val, test_data=test)
    record = second.fit(resume=True)
    scorings = 4 + 1  # val at steps 2, 4, 6, 8; test once
    assert record["wall_time_s"] >= scorings * 0.4
    assert 0 < paused["train_time_s"] <= record["train_time_s"]
    assert record["train_time_s"] < record["wall_time_s"] - scorings * 0.4
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["train_time_s"] == record["train_time_s"]


def test_the_record_names_the_step_whose_weights_the_model_holds(tmp_path):
    """The record's ``final`` row is the last evaluation's while ``test`` scored the restored
    best weights: ``model_step`` and ``model_metrics`` say which weights those are."""
    train, val = ContainsTask(64), ContainsTask(32, seed=1)
    cfg = {"eval_every": 3, "lr": 3e-2, "schedule": "constant", "monitor": "val_loss"}
    cfg.update(mode="min", out_dir=str(tmp_path))

    def build(steps, **kw):
        torch.manual_seed(0)
        config = _config(steps=steps, **{**cfg, **kw})
        return Trainer(_classifier(dropout=0.1), train, config, val_data=val, test_data=val)

    trainer = build(9)
    paused = trainer.fit(stop_after=4)  # not finished: the model holds step 4's weights
    assert paused["status"] == "paused" and paused["model_step"] == 4
    assert paused["model_metrics"] is None  # step 4 was not evaluated
    record = trainer.fit(resume=True)
    best = record["best"]["step"]
    assert best < 9 and record["model_step"] == best  # so the best and the last differ
    assert record["model_metrics"]["step"] == best
    assert record["model_metrics"]["val_loss"] == record["best"]["value"]
    assert record["final"]["step"] == 9 and record["test"] == trainer.evaluate(val)
    kept = build(9, restore_best=False, out_dir=str(tmp_path / "last")).fit()
    assert kept["model_step"] == 9 and kept["model_metrics"] == kept["final"]


def test_load_model_rebuilds_the_saved_model(tmp_path):
    """``load_model`` rebuilds a run's model from run.json's class and config and model.pt's
    weights: the restored best ones, in eval mode."""
    from kernelstudy.train import load_model

    train, val = ContainsTask(64), ContainsTask(32, seed=1)
    cfg = {"steps": 9, "eval_every": 3, "lr": 3e-2, "monitor": "val_loss", "mode": "min"}
    favor = {"name": "favor", "num_features": 6}  # its draws come back through the state
    torch.manual_seed(0)
    model = _classifier(attention="kernel", feature_map=favor, dropout=0.1)
    trainer = Trainer(model, train, _config(**cfg, out_dir=str(tmp_path / "cls")), val_data=val)
    record = trainer.fit()
    loaded = load_model(tmp_path / "cls")
    assert type(loaded) is ks.nn.SequenceClassifier and not loaded.training
    ids, mask = val.ids[:8], val.mask[:8]
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids, mask), trainer.model(ids, mask))  # the restored best
    assert record["model_step"] == record["best"]["step"]

    copy = CopyTask("train", seq_len=12, n_symbols=4, num_samples=32)
    lm = model_for_task(copy, **SMALL)
    Trainer(lm, copy, _config(steps=2, out_dir=str(tmp_path / "lm"))).fit()
    again = load_model(tmp_path / "lm")
    assert type(again) is ks.nn.CausalLM and again.config() == lm.config()
    tokens = torch.randint(0, copy.vocab_size, (2, 5))
    assert torch.equal(again.generate(tokens, 3), lm.generate(tokens, 3))

    with pytest.raises(FileNotFoundError, match="no run.json in"):
        load_model(tmp_path / "nothing")

    class Own(nn.Module):  # a user's model: no config to rebuild it from
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.out = nn.Embedding(8, 4), nn.Linear(4, 2)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(ids).mean(1))

    own = Own()
    out = tmp_path / "own"
    Trainer(own, train, _config(steps=1, out_dir=str(out), eval_every=1)).fit()
    with pytest.raises(ValueError, match="records model class 'Own' with no config"):
        load_model(out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_load_model_gives_the_model_in_the_dtype_it_trained_in(tmp_path, dtype):
    """A run of a float64 or bfloat16 model came back as a float32 model, its outputs not
    the run's (bf16: off by 1e-3); run.json records the dtype, an older record without it
    is read from model.pt."""
    from kernelstudy.train import load_model

    train, out = ContainsTask(32), tmp_path / "run"
    torch.manual_seed(0)
    model = _classifier().to(dtype)
    Trainer(model, train, _config(steps=2, out_dir=str(out))).fit()
    record = json.loads((out / "run.json").read_text())
    assert record["model"]["dtype"] == str(dtype).removeprefix("torch.")
    ids, mask = train.ids[:8], train.mask[:8]
    model.eval()
    with torch.no_grad():
        expected = model(ids, mask)
        loaded = load_model(out)
        assert loaded.embed.weight.dtype == dtype and torch.equal(loaded(ids, mask), expected)
        del record["model"]["dtype"]  # as a run recorded before the field
        (out / "run.json").write_text(json.dumps(record))
        assert torch.equal(load_model(out)(ids, mask), expected)
    record["model"]["dtype"] = "int8"
    (out / "run.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="records model dtype 'int8', not a torch floating"):
        load_model(out)


def test_a_model_compiled_by_the_caller_is_saved_and_recorded_as_the_model_inside(tmp_path):
    """Trained as ``torch.compile(model)``, run.json recorded class OptimizedModule and
    model.pt's keys all began with ``_orig_mod.``: neither load_model nor the model's own
    load_state_dict could read the run."""
    from kernelstudy.train import load_model

    train, out = ContainsTask(32), tmp_path / "run"
    torch.manual_seed(0)
    model = _classifier()
    compiled = torch.compile(model, backend="eager")
    trainer = Trainer(compiled, train, _config(steps=2, out_dir=str(out)))
    assert trainer.model is model and trainer.run_model is compiled
    record = trainer.fit()
    assert record["model"]["class"] == "SequenceClassifier"
    state = torch.load(out / "model.pt", weights_only=True)
    assert not any(key.startswith("_orig_mod.") for key in state)
    model.eval()
    ids, mask = train.ids[:8], train.mask[:8]
    with torch.no_grad():
        assert torch.equal(load_model(out)(ids, mask), model(ids, mask))


def test_load_model_names_a_damaged_file(tmp_path):
    """A cut, empty or foreign model.pt gave ``OSError: [Errno 22] Invalid argument``, a bare
    EOFError or ``KeyError: 101``, a cut run.json a JSONDecodeError naming no file."""
    from kernelstudy.train import load_model

    out = tmp_path / "run"
    Trainer(_classifier(), ContainsTask(32), _config(steps=1, out_dir=str(out))).fit()
    weights, record = (out / "model.pt").read_bytes(), (out / "run.json").read_text()
    for damaged in (weights[: len(weights) // 2], b"", bytes(range(256)) * 4):
        (out / "model.pt").write_bytes(damaged)
        with pytest.raises(ValueError, match=r"model\.pt is not a readable model file \("):
            load_model(out)
    (out / "model.pt").write_bytes(weights)
    # the device's and the allocator's errors are not the file's: raised as they are
    for error in ("CUDA out of memory", "Attempting to deserialize object on a CUDA device"):

        def failing_load(*args, error=error, **kwargs):
            raise RuntimeError(error)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "load", failing_load)
            with pytest.raises(RuntimeError, match=error):
                load_model(out)
    (out / "run.json").write_text(record[: len(record) // 2])
    with pytest.raises(ValueError, match=r"run\.json is not readable JSON"):
        load_model(out)


def test_another_models_files_are_value_errors_naming_them(tmp_path):
    """model.pt of another run (another size) and a run.json config key the class does not
    take raised torch's RuntimeError and a TypeError, naming no file; a checkpoint resumed
    into another model of the same shapes (another map) went on without a word, and the
    record named a model the first steps had not trained."""
    import json

    from kernelstudy.train import load_model

    small, large = tmp_path / "small", tmp_path / "large"
    Trainer(_classifier(), ContainsTask(32), _config(steps=1, out_dir=str(small))).fit()
    Trainer(_classifier(d_model=32), ContainsTask(32), _config(steps=1, out_dir=str(large))).fit()
    (small / "model.pt").write_bytes((large / "model.pt").read_bytes())
    with pytest.raises(ValueError, match=r"small/model\.pt does not fit the SequenceClassifier"):
        load_model(small)
    record = json.loads((large / "run.json").read_text())
    record["model"]["config"]["d_modle"] = 32
    (large / "run.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"large/run\.json: cannot rebuild .*'d_modle'"):
        load_model(large)

    paused = tmp_path / "paused"
    out = str(paused)
    Trainer(_classifier("elu"), ContainsTask(32), _config(steps=4, out_dir=out)).fit(stop_after=2)
    again = Trainer(_classifier("relu"), ContainsTask(32), _config(steps=4, out_dir=out))
    with pytest.raises(ValueError, match=r"into another model: .*attention \(saved 'elu', now"):
        again.fit(resume=True)
    state = torch.load(paused / "checkpoint.pt", weights_only=False)
    del state["model_identity"]  # as written before the check: the weights' shapes still are
    torch.save(state, paused / "checkpoint.pt")
    wider = Trainer(_classifier("elu", d_model=32), ContainsTask(32), _config(steps=4, out_dir=out))
    with pytest.raises(ValueError, match=r"checkpoint\.pt holds the weights of another model"):
        wider.fit(resume=True)
    same = Trainer(_classifier("elu"), ContainsTask(32), _config(steps=4, out_dir=out))
    assert same.fit(resume=True)["steps_completed"] == 4


def test_a_resume_into_a_model_of_another_non_dict_config_is_named(tmp_path):
    """A user's model whose config() is no dict (a preset's name) gave AttributeError from
    the message that compares configs, not the ValueError."""

    class Preset(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name, self.inner = name, _classifier()

        def forward(self, input_ids, mask):
            return self.inner(input_ids, mask)

        def config(self) -> str:
            return self.name

    out = str(tmp_path / "run")
    Trainer(Preset("small"), ContainsTask(32), _config(steps=4, out_dir=out)).fit(stop_after=2)
    again = Trainer(Preset("large"), ContainsTask(32), _config(steps=4, out_dir=out))
    with pytest.raises(ValueError, match=r"config differs \(saved 'small', now 'large'\)"):
        again.fit(resume=True)


def test_a_damaged_file_of_the_legacy_format_is_a_value_error(tmp_path):
    """torch's legacy (non-zip) reader reports a file cut short as RuntimeError "unexpected
    EOF", which escaped once only the zip reader's RuntimeErrors were taken as damage."""
    from kernelstudy.train.checkpoint import load_checkpoint

    path = tmp_path / "checkpoint.pt"
    buffer = io.BytesIO()
    torch.save({"step": 1, "w": torch.zeros(100)}, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue()
    for damaged in (data[:-50], data[: len(data) // 2]):
        path.write_bytes(damaged)
        with pytest.raises(ValueError, match="is not a readable checkpoint"):
            load_checkpoint(path)


def test_load_model_refuses_a_run_continued_past_its_finish(tmp_path, recwarn):
    """A finished run continued with more steps and paused keeps the first finish's model.pt,
    while run.json names the paused step: ``load_model`` returned those stale weights."""
    from kernelstudy.train import load_model

    train, val = ContainsTask(64), ContainsTask(32, seed=1)
    out = str(tmp_path / "run")

    def trainer(steps: int) -> Trainer:
        torch.manual_seed(0)
        cfg = _config(steps=steps, eval_every=2, lr=3e-2, out_dir=out)
        return Trainer(_classifier(), train, cfg, val_data=val)

    trainer(4).fit()
    load_model(out)  # finished: model.pt holds model_step's weights
    record = trainer(8).fit(stop_after=6, resume=True)
    assert record["status"] == "paused" and record["model_step"] == 6
    with pytest.raises(ValueError, match="records status 'paused', not a finished run"):
        load_model(out)


def test_evaluate_checks_max_batches():
    """``max_batches`` 0 or -1 raised "evaluation data yields no batches", 2.5 read as 3
    and "2" failed inside the loop; it is an int >= 1 or None."""
    trainer = Trainer(_classifier(), ContainsTask(8), _config(steps=1))
    data = ContainsTask(64)
    for bad in (0, -1, 2.5, "2", True):
        with pytest.raises(ValueError, match="max_batches must be an int >= 1"):
            trainer.evaluate(data, max_batches=bad)
    one = trainer.evaluate(data, max_batches=np.int64(1))  # numpy ints as elsewhere
    assert one == trainer.evaluate(data, max_batches=1) != trainer.evaluate(data)


def test_a_compiled_run_follows_eager_mode_and_resumes_exactly(tmp_path):
    """``compile=True`` runs the model's steps compiled whole (inductor). Without dropout the
    metrics follow eager mode's to float rounding (1e-4 relative). With dropout (inductor draws
    its own masks), k steps + resume + k steps == 2k steps bit for bit, as in eager mode (on
    one thread: inductor's CPU code, unlike eager mode's, differed in the last bit from run to
    run on two)."""
    train, val = ContainsTask(100), ContainsTask(40, seed=1)
    cfg = {"steps": 10, "eval_every": 4, "warmup_steps": 3, "schedule": "linear"}
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        config = _config(compile=compiled, **cfg)
        runs[compiled] = Trainer(_classifier(), train, config, val_data=val)
        runs[compiled].fit()
    eager, compiled = (runs[c].metrics.drop(columns=["elapsed_s"]) for c in (False, True))
    pd.testing.assert_frame_equal(compiled, eager, rtol=1e-4)

    torch._dynamo.reset()
    torch.manual_seed(0)
    straight = Trainer(_classifier(dropout=0.2), train, _config(compile=True, **cfg))
    straight.fit()
    out = str(tmp_path / "run")
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = _config(compile=True, out_dir=out, **cfg)
    Trainer(_classifier(dropout=0.2), train, config).fit(stop_after=5)
    torch._dynamo.reset()
    torch.manual_seed(123)  # a different init and global state: all comes from the checkpoint
    second = Trainer(_classifier(dropout=0.2), train, config)
    assert second.fit(resume=True)["status"] == "completed"
    a, b = _params(straight.model), _params(second.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_compiled_fits_one_after_another_in_one_process(monkeypatch):
    """Every model of a class shares one compiled forward and its recompile limit (8): two
    graphs a fit (training, evaluation), so the fifth compiled fit of a process (a search's
    trial, a notebook's model) failed with FailOnRecompileLimitHit, which ended the search."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real(m, backend="eager", **kw))
    train, val = ContainsTask(32), ContainsTask(16, seed=1)
    for i in range(6):  # each dropout value is a constant of its graphs
        cfg = _config(compile=True, steps=1, eval_every=1, batch_size=16)
        trainer = Trainer(_classifier(dropout=0.05 * i), train, cfg, val_data=val)
        assert trainer.fit()["status"] == "completed", i


def test_compile_refuses_maps_that_redraw_in_training():
    """A random map with redraw_every > 0 stopped a compiled run at its first redraw (dynamo
    cannot make the redraw's generators inside the graph): refused up front by name."""
    train = ContainsTask(32)
    redrawing = {"name": "favor", "num_features": 8, "redraw_every": 2}
    with pytest.raises(ValueError, match=r"FavorFeatureMap with redraw_every > 0.*redraw_every=0"):
        Trainer(_classifier(attention=redrawing), train, _config(compile=True))
    Trainer(_classifier(attention=redrawing), train, _config())  # eager mode redraws
    Trainer(_classifier(attention={**redrawing, "redraw_every": 0}), train, _config(compile=True))
    kept = _classifier(attention=redrawing)  # the caller keeps the maps from redrawing
    for fm in ks.nn.feature_maps_of(kept):
        fm.eval()
    Trainer(kept, train, _config(compile=True))


class _ShrunkModel(nn.Module):
    """A classifier whose regularizer is the squared norm of its own weights (loss and
    penalty pull on the same parameters, so their relative weight shows)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = _classifier()

    def forward(self, input_ids, mask=None):
        return self.inner(input_ids, mask)

    def regularization(self) -> torch.Tensor:
        return sum(p.square().sum() for p in self.inner.parameters())


def _norm_after(reg_weight: float) -> float:
    model = _ShrunkModel()
    cfg = _config(steps=6, weight_decay=0.0, reg_weight=reg_weight, clip_norm=None)
    Trainer(model, ContainsTask(32), cfg).fit()
    return float(torch.sqrt(model.regularization().detach()))


def test_reg_weight_scales_the_penalty_in_the_loss():
    """A larger reg_weight shrinks the penalized weights more (the weight multiplies the
    penalty; a trainer that added the penalty at weight 1 gave the same weights for both)."""
    weak, strong = _norm_after(1e-4), _norm_after(10.0)
    assert strong < weak - 1e-3


def test_weight_decay_spares_biases_named_with_a_suffix():
    """Hedgehog with tie_qk=False has a 3-d ``key_bias``: a bias by name (``*_bias``), so
    it takes no weight decay, as the map's own ``bias`` does."""
    model = _classifier(attention="hedgehog", feature_map_kwargs={"tie_qk": False})
    _, decayed = _decayed_parameters(model)
    key_biases = [n for n, _ in model.named_parameters() if n.endswith("key_bias")]
    assert key_biases and not set(key_biases) & decayed
    assert any(n.endswith("key_weight") for n in decayed)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_fit_trains_whatever_the_callers_grad_mode(mode):
    """fit() under no_grad or inference_mode (a notebook cell, an evaluation script) failed
    at its first step with "element 0 of tensors does not require grad"."""
    torch.manual_seed(0)
    trainer = Trainer(_classifier(), ContainsTask(32), _config(steps=2, eval_every=2))
    before = _params(trainer.model)
    with mode():
        assert trainer.fit()["status"] == "completed"
    after = _params(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_load_model_imports_no_module_its_record_names(tmp_path, monkeypatch):
    """A shared run folder's run.json naming ``feature_map = "module:Class"`` made
    load_model import that module, running its code (a file beside run.json is on sys.path
    in a notebook or ``python -c``): now refused unless the module is already imported,
    which a map of one's own still is."""
    import sys

    from kernelstudy.train import load_model

    train, out = ContainsTask(32), tmp_path / "run"
    torch.manual_seed(0)
    Trainer(_classifier(), train, _config(steps=1, out_dir=str(out))).fit()
    record = json.loads((out / "run.json").read_text())
    ran = tmp_path / "ran"
    (tmp_path / "planted_map_module.py").write_text(
        f"open({str(ran)!r}, 'w').close()\n"
        "from kernelstudy.feature_maps.elementary import EluFeatureMap as Planted\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "planted_map_module", raising=False)
    record["model"]["config"]["attention"] = "planted_map_module:Planted"
    (out / "run.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="module 'planted_map_module' is not imported"):
        load_model(out)
    assert not ran.exists()
    import planted_map_module  # noqa: F401  the user's own module, imported: loads

    ran.unlink()
    assert type(load_model(out)) is ks.nn.SequenceClassifier
    assert not ran.exists()


def test_loader_workers_fork_on_linux_unless_the_program_chose(monkeypatch):
    """Python 3.14 starts DataLoader workers on Linux through a forkserver in the training
    process's group: a SIGTERM to the group (``timeout``) killed it, the run failed and kept no
    checkpoint (reproduced on 3.13 with forkserver as the default). Workers fork there as up to
    3.13; a start method the program set, and other platforms, keep Python's choice."""

    from kernelstudy.train import data as data_module

    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    monkeypatch.setattr(data_module.sys, "platform", "linux")
    monkeypatch.setattr(data_module.mp, "get_start_method", lambda allow_none=False: None)
    loader = data_module.make_loader(data, batch_size=2, num_workers=1)
    assert loader.multiprocessing_context.get_start_method() == "fork"
    assert data_module.make_loader(data, batch_size=2).multiprocessing_context is None
    monkeypatch.setattr(data_module.mp, "get_start_method", lambda allow_none=False: "spawn")
    assert data_module.worker_context() is None  # the program's choice
    monkeypatch.setattr(data_module.mp, "get_start_method", lambda allow_none=False: None)
    monkeypatch.setattr(data_module.sys, "platform", "darwin")
    assert data_module.worker_context() is None
