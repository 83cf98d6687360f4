"""Search configs, search spaces from the registry, and storages by URL."""

from __future__ import annotations

import optuna
import pytest

from kernelstudy.search.config import load_config
from kernelstudy.search.space import TRAINING_SPACE, suggest_feature_map, suggest_training
from kernelstudy.search.storage import open_storage

GOOD = """
name = "tiny"
task = "listops"
data = "data"
[task_options]
max_length = 64
[model]
d_model = 16
n_heads = 2
[search]
trials = 3
[[variants]]
label = "Transformer"
attention = "softmax"
[[variants]]
label = "elu"
feature_map = "elu"
[quick.search]
trials = 1
"""


def _write(tmp_path, text):
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def test_config_loads_and_quick_overrides(tmp_path):
    path = _write(tmp_path, GOOD)
    cfg = load_config(path)
    assert cfg.trials == 3 and cfg.labels() == ["Transformer", "elu"]
    assert cfg.data == (tmp_path / "data").resolve()
    assert load_config(path, quick=True).trials == 1
    assert cfg.study_name(cfg.variant("elu")) == "tiny/elu"


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.replace('task = "listops"', 'task = "listopz"'), "listops"),
        (lambda s: s.replace('feature_map = "elu"', 'feature_map = "eluu"'), "elu"),
        (lambda s: s.replace("max_length = 64", "max_len = 64"), "max_len"),
        (lambda s: s.replace("[model]", "[task_options.val]\nmax_len = 8\n[model]"), "val.max_len"),
        (lambda s: s + "\n[[variants]]\nlabel = 'x'\nfeature_map = 'elu'\nfixed = {k = 1}\n", "k"),
        (lambda s: s.replace("[search]", "[search]\npruner = 'sometimes'"), "pruner"),
        (lambda s: s.replace("name =", "nam ="), "nam"),
        (lambda s: s + "\n[[oops", "TOML"),
        (lambda s: s.replace("[search]", "[train]\nmonitor = 'bogus'\n[search]"), "monitor"),
        (lambda s: s.replace("[search]", "[train]\nbetas = 3\n[search]"), r"\[train\]: betas"),
    ],
)
def test_bad_configs_fail_before_training(tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load_config(_write(tmp_path, edit(GOOD)))


def test_per_split_task_options_reach_the_loaded_splits(tmp_path):
    from kernelstudy.search.objective import load_split
    from kernelstudy.tasks import write_listops

    text = GOOD.replace("[model]", "[task_options.val]\nmax_length = 30\n[model]")
    cfg = load_config(_write(tmp_path, text))
    assert cfg.task_options == {"max_length": 64, "val": {"max_length": 30}}
    write_listops(tmp_path / "data", n_train=8, n_val=4, n_test=4, min_length=10, max_length=40)
    assert load_split(cfg, cfg.data, "val").max_length == 30
    assert load_split(cfg, cfg.data, "train").max_length == 64


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere"):
        load_config(tmp_path / "nothere.toml")


def test_training_space_suggestions_respect_ranges():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        params = suggest_training(trial, {"dropout": 0.0, "lr": {"low": 1e-4, "high": 1e-3}})
        assert params["dropout"] == 0.0 and 1e-4 <= params["lr"] <= 1e-3
        spec = TRAINING_SPACE["weight_decay"]
        assert spec.low <= params["weight_decay"] <= spec.high
        study.tell(trial, 0.0)
    with pytest.raises(ValueError, match="momentum"):
        suggest_training(study.ask(), {"momentum": 0.9})


def test_feature_map_space_comes_from_declarations():
    from kernelstudy.feature_maps.registry import get_feature_map_class

    study = optuna.create_study()
    for name in ("elu",):
        cls = get_feature_map_class(name)
        params = suggest_feature_map(study.ask(), name)
        assert set(params) <= set(cls.hyperparameters)
    with pytest.raises(ValueError, match="no hyperparameter"):
        suggest_feature_map(study.ask(), "elu", {"depth": 2})


def test_storage_errors_name_the_url(tmp_path):
    assert open_storage(f"sqlite:///{tmp_path / 's.db'}") is not None
    with pytest.raises(ValueError, match="database URL"):
        open_storage("results/study.db")
    for memory in ("sqlite://", "sqlite:///", "sqlite:///:memory:"):
        with pytest.raises(ValueError, match="in-memory database"):
            open_storage(memory)
    with pytest.raises(ValueError, match=r"127\.0\.0\.1:1"):
        open_storage("postgresql://user:secret@127.0.0.1:1/db")
    try:
        open_storage("postgresql://user:secret@127.0.0.1:1/db")
    except ValueError as err:
        assert "secret" not in str(err)


PERFORMER = """
[[variants]]
label = "Performer"
feature_map = "favor"
fixed = { num_features = { low = 16, high = 256, log = true } }
[[variants]]
label = "elu+1"
feature_map = "elu"
"""
QUICK_PERFORMER = """
[quick.variants.Performer]
fixed = { num_features = { low = 8, high = 32 } }
"""


def test_quick_overrides_one_variants_range(tmp_path):
    path = _write(tmp_path, GOOD + QUICK_PERFORMER + PERFORMER)
    full, quick = load_config(path), load_config(path, quick=True)
    # Full mode: the variant as declared; quick: merged key by key (log kept).
    assert full.variant("Performer").fixed == {
        "num_features": {"low": 16, "high": 256, "log": True}
    }
    assert quick.variant("Performer").fixed == {"num_features": {"low": 8, "high": 32, "log": True}}
    assert quick.labels() == full.labels() == ["Transformer", "elu", "Performer", "elu+1"]
    others = [v for v in quick.variants if v.label != "Performer"]
    assert others == [v for v in full.variants if v.label != "Performer"]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    drawn = set()
    for _ in range(30):
        trial = study.ask()
        drawn.add(
            suggest_feature_map(trial, "favor", quick.variant("Performer").fixed)["num_features"]
        )
        study.tell(trial, 0.0)
    assert drawn and min(drawn) >= 8 and max(drawn) <= 32
    # A fixed value replaces the range; a quoted label reaches a variant like "elu+1".
    path.write_text(
        GOOD
        + "\n[quick.variants.Performer]\nfixed = { num_features = 16 }\n"
        + '\n[quick.variants."elu+1".fixed]\n'
        + PERFORMER
    )
    quick = load_config(path, quick=True)
    assert quick.variant("Performer").fixed == {"num_features": 16}
    assert quick.variant("elu+1").fixed == {}


@pytest.mark.parametrize(
    "override, match",
    [
        # unknown variant label: named, with the labels there are
        ("[quick.variants.Performr]\nfixed = { num_features = 16 }", r"Performr.*'Performer'"),
        ('[quick.variants."elu 1"]\nfixed = {}', r'variants\."elu 1".*no variant.*elu\+1'),
        # unknown hyperparameter of the variant's map: named, with the map's hyperparameters
        ("[quick.variants.Performer]\nfixed = { num_feature = 16 }", r"num_feature.*num_features"),
        # only `fixed` may change
        ("[quick.variants.Performer]\nfeature_map = 'elu'", r"feature_map.*allowed: \['fixed'\]"),
        ("[quick.variants.Performer]\nfixed = 16", "fixed must be a table"),
        ("[quick.variants.Performer]\nfixed = { num_features = { hi = 32 } }", r"hi.*'high'"),
        ("[quick.variants.Transformer]\nfixed = { depth = 1 }", "softmax attention"),
        ("[[quick.variants]]\nlabel = 'Performer'", r"\[quick\.variants\.Performer\]"),
    ],
)
def test_bad_quick_variant_overrides(tmp_path, override, match):
    path = _write(tmp_path, GOOD + "\n" + override + "\n" + PERFORMER)
    for quick in (True, False):  # checked in full mode too
        with pytest.raises(ValueError, match=match):
            load_config(path, quick=quick)
