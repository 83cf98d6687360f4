"""Search configs, search spaces from the registry, and storages by URL."""

from __future__ import annotations

import optuna
import pytest

from kernelstudy.search.config import load_config
from kernelstudy.search.space import (
    TRAINING_SPACE,
    suggest,
    suggest_feature_map,
    suggest_training,
)
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
        # a path given to a synthetic task was ignored without a word (kernelstudy train
        # refuses it)
        (
            lambda s: s.replace('task = "listops"', 'task = "copy"').replace(
                "max_length = 64", "seq_len = 16"
            ),
            "task 'copy' is synthetic and reads no data",
        ),
        (lambda s: s.replace("name =", "nam ="), "nam"),
        (lambda s: s + "\n[[oops", "TOML"),
        (lambda s: s.replace("[search]", "[train]\nmonitor = 'bogus'\n[search]"), "monitor"),
        (lambda s: s.replace("[search]", "[train]\nbetas = 3\n[search]"), r"\[train\]: betas"),
        (  # one of the two silently won
            lambda s: s.replace(
                "n_heads = 2", "n_heads = 2\npositional = 'learned'\npositions = 'none'"
            ),
            "both positions and its alias positional",
        ),
        # [generate]'s values were checked only when the data were written (the docstring's
        # own example, without min_length, was refused there: its default 500 > 64)
        (
            lambda s: (
                s.replace('data = "data"', "") + "[generate]\nn_train = 20\nmax_length = 64\n"
            ),
            r"\[generate\]: need max_length >= min_length \+ 2",
        ),
        (
            lambda s: s.replace('data = "data"', "") + "[generate]\nn_train = 'many'\n",
            r"\[generate\]: n_train must be an int >= 1, got 'many'",
        ),
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


def test_loaded_splits_follow_files_rewritten_in_the_data_folder(tmp_path, monkeypatch):
    """The per-process cache of loaded splits was keyed on the folder's path alone: data
    rewritten there during a session (``kernelstudy data listops --overwrite`` from another
    process) was never read again; trials trained on the old rows without a word."""
    import os
    from pathlib import Path

    from kernelstudy.search.objective import load_split
    from kernelstudy.tasks import write_listops

    cfg = load_config(_write(tmp_path, GOOD))
    write_listops(tmp_path / "data", n_train=8, n_val=4, n_test=4, min_length=10, max_length=40)
    first = load_split(cfg, cfg.data, "train")
    assert load_split(cfg, cfg.data, "train") is first  # unchanged files: the cached split
    write_listops(tmp_path / "data", n_train=12, n_val=4, n_test=4, min_length=10,
                  max_length=40, seed=1, overwrite=True)  # fmt: skip
    train = tmp_path / "data" / "basic_train.tsv"
    os.utime(train, ns=(train.stat().st_atime_ns, train.stat().st_mtime_ns + 10**9))
    assert len(load_split(cfg, cfg.data, "train")) == 12
    # a folder beside the data that one may not read (lost+found, another user's) is
    # left out of the signature (a PermissionError ended the search)
    (tmp_path / "data" / "private").mkdir()
    real = Path.iterdir

    def iterdir(self):
        if self.name == "private":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    assert len(load_split(cfg, cfg.data, "train")) == 12


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
    # SQLite's URI filenames too: they ran every trial against a database that vanished
    uris = ("sqlite:///file:x.db?mode=memory&uri=true", "sqlite:///file::memory:?uri=true")
    for memory in ("sqlite://", "sqlite:///", "sqlite:///:memory:", *uris):
        with pytest.raises(ValueError, match="in-memory database"):
            open_storage(memory)
    file_uri = f"sqlite:///file:{tmp_path / 'u.db'}?uri=true"  # a file, named as a URI
    assert open_storage(file_uri) is not None and (tmp_path / "u.db").is_file()
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


def _elu(line: str) -> str:
    """GOOD with ``line`` added to its "elu" variant."""
    return GOOD.replace('feature_map = "elu"', f'feature_map = "elu"\n{line}')


def _minimal(top: str, variants: str = '[[variants]]\nlabel = "elu"\nfeature_map = "elu"\n'):
    return f'name = "tiny"\ntask = "listops"\n{top}\n{variants}'


@pytest.mark.parametrize(
    "text, match",
    [
        # the search maximizes val_accuracy: monitor/mode would make it pick the worst trial
        (GOOD.replace("[search]", "[train]\nmonitor = 'val_loss'\n[search]"), r"monitor.*maximiz"),
        (GOOD.replace("[search]", "[train]\nmode = 'min'\n[search]"), r"'mode'.*maximiz"),
        # unknown [[variants]] keys: named, with the allowed ones and a close match
        (_elu("fixd = { seed = 1 }"), r"variant 'elu'.*'fixd'.*'fixed'.*label, attention"),
        (_elu("featuremap = 'glu'"), r"variant 'elu'.*'featuremap'.*'feature_map'"),
        (
            GOOD.replace('attention = "softmax"', 'attention = "softmax"\nfeature_map = "elu"'),
            "softmax",
        ),
        # ranges and fixed values within the declared ones
        (GOOD + "[space]\ndropout = { low = 0.5, high = 2.0 }\n", r"\[space\].*dropout.*0\.3"),
        (GOOD + "[space]\ndropout = 0.9\n", r"\[space\].*dropout.*0\.3"),
        (GOOD + "[space]\nlr = { low = 1e-3, high = 1e-4 }\n", r"\[space\].*lr.*above"),
        (GOOD.replace("d_model = 16", "d_model = 16\ndropout = 2.0"), r"\[model\].*dropout"),
        (
            GOOD.replace("d_model = 16", "d_model = 16\ndropout = 0.2")
            + "[space]\ndropout = 0.1\n",
            r"dropout is set in both \[model\] \(0\.2\) and \[space\] \(0\.1\)",
        ),
        (
            GOOD + PERFORMER.replace("low = 16", "low = 0"),
            r"variant 'Performer'.*num_features\.low must be >= 1",
        ),
        (
            _minimal("", "[[variants]]\nlabel = 'g'\nfeature_map = 'glu'\nfixed = { seed = -1 }"),
            r"variant 'g'.*seed must be >= 0",
        ),
        (
            _minimal("", "[[variants]]\nlabel = 'g'\nfeature_map = 'glu'\nfixed = { depth = 5 }"),
            r"variant 'g'.*depth must be <= 3",
        ),
        (
            _minimal(
                "",
                "[[variants]]\nlabel = 'P'\nfeature_map = 'favor'\n"
                "fixed = { row_norms = { choices = ['chi', 'bogus'] } }",
            ),
            r"variant 'P'.*row_norms.*one of",
        ),
        (
            GOOD
            + "\n[quick.variants.Performer]\nfixed = { num_features = { low = 0 } }\n"
            + PERFORMER,
            r"quick\.variants\.Performer.*num_features\.low must be >= 1",
        ),
        # [train] device must name a device (whether it is here is checked by search)
        (GOOD.replace("[search]", "[train]\ndevice = 'tpu'\n[search]"), r"\[train\] device.*tpu"),
        # arguments of the wrong type, named
        (_minimal("model = 5"), r"model must be a table"),
        (_minimal("space = 5"), r"space must be a table"),
        (_minimal("task_options = 7"), r"task_options must be a table"),
        (_minimal("data = 5"), r"data must be a path"),
        (
            _minimal("", "[[variants]]\nlabel = 'g'\nfeature_map = 'glu'\nfixed = 5"),
            r"variant 'g'.*fixed must be a table",
        ),
        (GOOD.replace("trials = 3", "trials = 'many'"), r"\[search\] trials must be an int"),
        (GOOD.replace("trials = 3", "trials = 1.9"), r"\[search\] trials must be an int"),
        (GOOD.replace("trials = 3", "trials = true"), r"\[search\] trials must be an int"),
        (GOOD.replace("trials = 3", "trials = 0"), r"\[search\] trials must be an int >= 1"),
        (GOOD.replace("trials = 3", "seed = 'x'"), r"\[search\] seed must be an int"),
        (_minimal("variants = []", ""), r"at least one \[\[variants\]\]"),
        (_minimal("", ""), r"missing required key 'variants'"),
        (
            GOOD + "[space]\nlr = { low = 1e-4, high = 1e-3, log = 'false' }\n",
            r"lr\.log.*true or false",
        ),
        (
            _minimal(
                "",
                "[[variants]]\nlabel = 'P'\nfeature_map = 'favor'\n"
                "fixed = { num_features = { choices = '816' } }",
            ),
            r"num_features\.choices must be a non-empty list",
        ),
        # name: a folder and a study-name prefix
        (GOOD.replace('name = "tiny"', 'name = "a/b"'), r"name must be letters.*'a/b'"),
        (GOOD.replace('name = "tiny"', 'name = ".."'), r"name must be.*'\.\.'"),
        (GOOD.replace('name = "tiny"', 'name = ""'), r"name must be.*not empty"),
        (GOOD.replace('name = "tiny"', "name = 5"), r"name must be"),
    ],
    ids=lambda v: "cfg" if "\n" in v else None,
)
def test_config_checks_name_the_file_and_key(tmp_path, text, match):
    with pytest.raises(ValueError, match=match) as info:
        load_config(_write(tmp_path, text))
    assert "cfg.toml" in str(info.value)


def test_device_is_checked_before_any_trial(tmp_path):
    """A config's [train] device is a device name at load; whether it exists here is
    checked by search and evaluate before the first trial, after --device overrides it
    (a config for a GPU machine still loads, reports and runs with --device cpu)."""
    import torch

    from kernelstudy.search.runner import check_device

    for device in ("auto", "cpu", "cuda"):
        text = GOOD.replace("[search]", f"[train]\ndevice = '{device}'\n[search]")
        config = load_config(_write(tmp_path, text))
        assert config.train["device"] == device
        check_device(config, "cpu")  # the override wins
        if device == "cuda" and not torch.cuda.is_available():
            with pytest.raises(ValueError, match=r"cfg\.toml: \[train\] device.*--device"):
                check_device(config, None)
        else:
            check_device(config, None)


def test_check_override_accepts_declared_ranges():
    from kernelstudy.feature_maps.base import Hyperparameter
    from kernelstudy.search.space import check_override

    flag, mode = Hyperparameter(bool, False), Hyperparameter(str, "a", choices=("a", "b"))
    for spec in (flag, mode, TRAINING_SPACE["lr"]):
        check_override("x", spec, {})  # searched over its declared range or choices
    check_override("x", mode, {"choices": ["b"]})
    with pytest.raises(ValueError, match="choices"):
        check_override("x", mode, {"low": "a"})
    study = optuna.create_study()
    assert suggest(study.ask(), "x", flag) in (False, True)


@pytest.mark.parametrize(
    "spec, override",
    [
        # choices with a range: the range was silently dropped (choices won)
        (TRAINING_SPACE["lr"], {"choices": [1e-4, 1e-3], "low": 1e-5}),
        (TRAINING_SPACE["lr"], {"choices": [1e-4, 1e-3], "log": True}),
        # a log scale on a categorical: silently ignored
        (None, {"log": True}),
        (None, {"choices": ["a"], "log": False}),
    ],
)
def test_check_override_refuses_ranges_that_would_be_ignored(spec, override):
    from kernelstudy.feature_maps.base import Hyperparameter
    from kernelstudy.search.space import check_override

    spec = spec or Hyperparameter(str, "a", choices=("a", "b"))
    with pytest.raises(ValueError, match=r"'?x'?.*choices"):
        check_override("x", spec, override)
    with pytest.raises(ValueError, match="choices"):
        check_override("flag", Hyperparameter(bool, False), {"log": True})


def test_a_range_narrowed_to_one_value_is_accepted():
    """low == high pins a searched float to one value (the bounds are inclusive); it was
    refused as "low is above high"."""
    from kernelstudy.search.space import check_override

    lr = TRAINING_SPACE["lr"]
    check_override("lr", lr, {"low": 3e-3, "high": 3e-3})
    assert suggest(optuna.create_study().ask(), "lr", lr, {"low": 3e-3, "high": 3e-3}) == 3e-3
    with pytest.raises(ValueError, match="above"):
        check_override("lr", lr, {"low": 3e-3, "high": 2e-3})


def test_default_value_keeps_a_default_the_choices_hold():
    """A narrowing to choices that include the declared default keeps it; only a default left
    out falls back to the first choice (256 among [64, 256, 1024] became 64)."""
    from kernelstudy.feature_maps.base import Hyperparameter
    from kernelstudy.search.space import default_value

    spec = Hyperparameter(int, 256, low=8, high=4096, log=True)
    assert default_value(spec, {"choices": [64, 256, 1024]}) == 256
    assert default_value(spec, {"choices": [64, 1024]}) == 64
    mode = Hyperparameter(str, "b", choices=("a", "b"))
    assert default_value(mode) == "b"


def test_default_value_clamps_into_a_narrowed_range():
    """A default outside the narrowed range is clamped to the nearer end: 256 with
    [16, 128] is 128 (it became low, 16), 4 with [16, 128] is 16."""
    from kernelstudy.feature_maps.base import Hyperparameter
    from kernelstudy.search.space import default_value

    spec = Hyperparameter(int, 256, low=8, high=4096, log=True)
    assert default_value(spec, {"low": 16, "high": 128}) == 128
    assert default_value(spec, {"low": 512, "high": 1024}) == 512
    assert default_value(spec, {"low": 16, "high": 1024}) == 256


def test_an_int_on_a_log_scale_is_suggested_on_a_log_scale():
    """An int hyperparameter declared log=True is sampled on a log scale, as floats are
    (suggest_int dropped the flag: 8..4096 sampled uniformly)."""
    from kernelstudy.feature_maps.base import Hyperparameter

    spec = Hyperparameter(int, 256, low=8, high=4096, log=True)
    trial = optuna.create_study().ask()
    suggest(trial, "fm.num_features", spec)
    assert trial.distributions["fm.num_features"] == optuna.distributions.IntDistribution(
        8, 4096, log=True
    )
    trial = optuna.create_study().ask()
    suggest(trial, "n", Hyperparameter(int, 4, low=1, high=8))
    assert not trial.distributions["n"].log


def test_valid_names_ranges_and_studies_still_load(tmp_path):
    text = GOOD.replace('name = "tiny"', 'name = "lra-listops_v1.2"')
    text += "[space]\ndropout = 0.0\nlr = { low = 1e-4, high = 1e-3, log = true }\n"
    cfg = load_config(_write(tmp_path, text + PERFORMER))
    assert cfg.name == "lra-listops_v1.2" and cfg.training_space["dropout"] == 0.0
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parents[1] / "studies").glob("lra_*.toml")):
        for quick in (False, True):
            assert load_config(path, quick=quick).variants


@pytest.mark.parametrize(
    ("quick", "match"),
    [
        ("quick = 5\n", r"quick must be a table \(\[quick\]\), got 5"),
        ("[quick]\ntrian = { steps = 2 }\n", r"unknown .*trian.*\(in \[quick\]"),
        ("[quick.search]\ntrails = 3\n", r"trails.*\(in \[quick\]"),
        ("[quick.train]\nsteps = -3\n", r"steps.*\(in \[quick\]"),
    ],
)
def test_the_quick_table_is_checked_in_full_mode_too(tmp_path, quick, match):
    """A typo in [quick] used to load fine in full mode and fail only with --quick; its
    message then named the top-level table ("[train]: steps ..."), which was right."""
    text = GOOD.replace("[quick.search]\ntrials = 1\n", "")
    if quick.startswith("quick ="):  # a top-level key, before the first table
        text = text.replace('task = "listops"\n', f'task = "listops"\n{quick}')
    else:
        text += quick
    for mode in (False, True):
        with pytest.raises(ValueError, match=match):
            load_config(_write(tmp_path, text), quick=mode)
    assert load_config(_write(tmp_path, GOOD)).name == "tiny"


def test_messages_hide_a_password_in_the_credentials_or_the_query():
    from kernelstudy.search.storage import redact

    assert redact("postgresql://u:secret@host:5432/db") == "postgresql://u:***@host:5432/db"
    hidden = redact("postgresql://host/db?user=u&password=secret&sslmode=require")
    assert hidden == "postgresql://host/db?user=u&password=***&sslmode=require"
    assert redact("sqlite:///runs/optuna.db") == "sqlite:///runs/optuna.db"
    assert redact("postgresql://u@h/db") == "postgresql://u@h/db"
    assert redact("postgresql://a:pa?ss@h/db") == "postgresql://a:***@h/db"  # ? in it


def test_the_report_warns_where_the_search_chose_on_the_test_set(tmp_path, capsys):
    """LRA Text reads IMDB's test reviews as val: nothing said so outside the task module."""
    import optuna

    from kernelstudy.search.report import load_results

    url = f"sqlite:///{tmp_path / 'study.db'}"
    for task in ("text", "listops"):
        study = optuna.create_study(
            study_name=f"{task}_demo/elu",
            storage=url,
            direction="maximize",  # as a search's
        )
        study.set_user_attr("task", task)
        study.add_trial(optuna.trial.create_trial(value=0.5))
        load_results(f"{task}_demo", storage=url, out=tmp_path)
        warned = "chose on the test set" in capsys.readouterr().err
        assert warned == (task == "text")


def test_the_budget_is_extra_parameters_over_the_model_without_its_maps():
    """The paper keeps "additional parametrization below 10%": 2048 map parameters on a
    19050-parameter model are 10.75% extra (9.71% of the total) and were let through."""
    from kernelstudy.search.objective import over_budget

    sizes = {"params_model": 19050 + 2048, "params_feature_map": 2048}
    sizes["feature_map_extra"] = 2048 / 19050
    reason = over_budget(sizes, 0.10)
    assert reason is not None and "10.8% extra over the model's 19050" in reason
    assert over_budget(sizes, 0.11) is None


def test_optimization_history_counts_complete_trials_only():
    """A pruned trial's value is its last intermediate report: the best-so-far curve showed
    it though the search's best trial (complete only) never can be that trial."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from kernelstudy.search.report import figures

    trials = pd.DataFrame(
        {
            "config": "c",
            "task": "listops",
            "variant": "elu",
            "number": [0, 1, 2],
            "state": ["COMPLETE", "PRUNED", "COMPLETE"],
            "val_accuracy": [0.30, 0.90, 0.40],
        }
    )
    fig = figures(trials)["optimization_history"]
    ys = [y for line in fig.axes[0].lines for y in line.get_ydata()]
    plt.close("all")
    assert ys and max(ys) == pytest.approx(40.0)


@pytest.mark.parametrize("folder", ["runs?2", "run %41"])
def test_a_results_folder_with_url_characters_keeps_its_study_there(tmp_path, folder):
    """The default SQLite URL put the path in unencoded: SQLAlchemy read ``runs?2/..`` as the
    file ``runs`` (the study written beside the results folder, where no report looked for
    it) and decoded ``%41`` (a file in a folder that does not exist)."""
    from kernelstudy.search.storage import (
        default_storage_url,
        existing_database,
        existing_storage_url,
        load_study,
    )

    url = default_storage_url(tmp_path / folder, "tiny")
    optuna.create_study(study_name="tiny/elu", storage=open_storage(url))
    assert (tmp_path / folder / "tiny" / "optuna.db").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder]  # nothing beside it
    again = existing_storage_url(tmp_path / folder, "tiny", "search first")
    assert load_study(again, "tiny/elu").study_name == "tiny/elu"
    assert existing_database(again, "search first") == again
    with pytest.raises(FileNotFoundError, match="no study database"):
        existing_database(url.replace("tiny/optuna.db", "other.db"), "search first")


def test_a_config_that_is_not_utf8_is_named(tmp_path):
    """A Latin-1 byte in a config raised a bare UnicodeDecodeError naming no file."""
    path = tmp_path / "cfg.toml"
    path.write_bytes(GOOD.replace('"elu"\n', '"élu"\n', 1).encode("latin-1"))
    with pytest.raises(ValueError, match=r"cfg\.toml is not valid TOML \(not UTF-8\)"):
        load_config(path)


def test_variants_given_as_one_str_are_refused(tmp_path):
    """``run_search(cfg, variants="ab")`` took each character for a label and searched
    variants ``a`` and ``b``."""
    from kernelstudy.search.runner import select_variants

    two = GOOD.replace('label = "Transformer"', 'label = "a"').replace(
        'label = "elu"', 'label = "b"'
    )
    config = load_config(_write(tmp_path, two))
    assert [v.label for v in select_variants(config, ["b", "b"])] == ["b"]
    with pytest.raises(TypeError, match="variants must be a list of labels, got the str 'ab'"):
        select_variants(config, "ab")


def test_report_targets_given_as_one_str_are_refused(tmp_path):
    """``write_report("tiny.toml")`` took each character for a target and failed with "no
    study database .../t/optuna.db"."""
    from kernelstudy.search.report import write_report

    for one in ("tiny.toml", tmp_path / "tiny.toml"):
        with pytest.raises(TypeError, match="targets must be a list of config files"):
            write_report(one, out=tmp_path)


def test_missing_listops_data_says_how_to_make_them(tmp_path):
    """Missing ListOps data told the user of the ListOps config to "use the ListOps config";
    it now names --quick and the command that writes the files where the config reads them."""
    from kernelstudy.search.objective import prepare_data

    cfg = load_config(_write(tmp_path, GOOD))
    with pytest.raises(FileNotFoundError) as err:
        prepare_data(cfg, tmp_path / "out")
    message = str(err.value)
    assert "--quick" in message and "use the ListOps config" not in message
    assert f"kernelstudy data listops --out {tmp_path / 'data'}" in message
    text = GOOD.replace('task = "listops"', 'task = "text"')
    with pytest.raises(FileNotFoundError, match="Long Range Arena release"):
        prepare_data(load_config(_write(tmp_path, text)), tmp_path / "out")


def test_a_search_that_fails_its_checks_leaves_no_empty_database(tmp_path):
    """A search whose data were missing left OUT/NAME/optuna.db behind, empty of studies, and
    `report` then said "no studies ... run search first"; a database that held studies before
    is kept."""
    from kernelstudy.search import run_search

    cfg = load_config(_write(tmp_path, GOOD))
    out = tmp_path / "out"
    # the hint said --quick would generate data, also for a config whose [quick] does not
    with pytest.raises(FileNotFoundError, match=r"not found at .* where the config's \[quick\]"):
        run_search(cfg, out=out)
    assert not (out / "tiny" / "optuna.db").exists()
    db = tmp_path / "kept.db"
    optuna.create_study(storage=f"sqlite:///{db}", study_name="other")
    with pytest.raises(FileNotFoundError, match="not found at"):
        run_search(cfg, out=out, storage=f"sqlite:///{db}")
    assert db.is_file()


def test_a_failed_search_keeps_a_database_another_search_joined_meanwhile(tmp_path, monkeypatch):
    """The file this search made was removed whatever it held by then: a second search of
    the same name and --out had joined it and finished trials, and lost them (stopped with
    Ctrl-C while preparing, the first search took the second's trials with it)."""
    from kernelstudy.search import run_search, runner

    cfg = load_config(_write(tmp_path, GOOD))
    out = tmp_path / "out"
    url = f"sqlite:///{out / 'tiny' / 'optuna.db'}"

    def joined_then_stopped(*args, **kwargs):  # the other search, during this one's checks
        other = optuna.create_study(storage=url, study_name="tiny/elu+1")
        other.add_trial(optuna.trial.create_trial(value=0.5))
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "prepare_data", joined_then_stopped)
    with pytest.raises(KeyboardInterrupt):
        run_search(cfg, out=out)
    assert len(optuna.load_study(study_name="tiny/elu+1", storage=url).trials) == 1


def test_the_connect_timeout_goes_only_to_drivers_that_take_it():
    """Every server URL got psycopg2's connect_timeout=10: a driver without that argument
    (Oracle's, SQL Server's pyodbc) failed every connect with a TypeError from the driver."""
    from kernelstudy.search.storage import engine_options

    assert engine_options("sqlite:///s.db") == {"connect_args": {"timeout": 60}}
    expected = {
        "postgresql://u@h/db": {"connect_timeout": 10},
        "postgresql+psycopg://u@h/db": {"connect_timeout": 10},
        "postgresql+pg8000://u@h/db": {"timeout": 10},
        "mysql+pymysql://u@h/db": {"connect_timeout": 10},
        "mysql+mysqlconnector://u@h/db": {"connection_timeout": 10},
    }
    for url, connect_args in expected.items():
        assert engine_options(url) == {"pool_pre_ping": True, "connect_args": connect_args}, url
    for url in ("oracle+oracledb://u@h/db", "mssql+pyodbc://u@dsn", "not a url://"):
        assert engine_options(url) == {"pool_pre_ping": True}, url


def _searched_study(url: str, name: str, task: str = "listops") -> optuna.Study:
    """An empty study as a search makes one: maximizing, its task recorded."""
    study = optuna.create_study(study_name=name, storage=url, direction="maximize")
    study.set_user_attr("task", task)
    return study


def test_the_report_follows_what_the_search_recorded_of_the_val_split(tmp_path, capsys):
    """Whether val read the test data is recorded per study by the search (user attr
    ``val_reads_test``); a study searched before that was recorded follows the task-name rule
    (text: yes), and names that rule, as its data may have held a val table."""
    from kernelstudy.search.report import StudySet, load_results, table_notes

    url = f"sqlite:///{tmp_path / 'study.db'}"
    cases = {  # name: (task, recorded attr per variant, warned, note)
        "text_val": ("text", {"elu": False}, False, None),
        "text_fallback": ("text", {"elu": True}, True, "text: the val split read the test"),
        "text_old": ("text", {"elu": None}, True, "the search ran before it recorded which"),
        "listops_old": ("listops", {"elu": None}, False, None),
        "listops_test": ("listops", {"elu": True}, True, "listops: the val split read the test"),
        "mixed": ("text", {"elu": True, "glu": False}, True, "text: the val split of elu read the"),
    }
    for name, (task, recorded, warned, note) in cases.items():
        for label, value in recorded.items():
            study = _searched_study(url, f"{name}/{label}", task)
            if value is not None:
                study.set_user_attr("val_reads_test", value)
            study.add_trial(optuna.trial.create_trial(value=0.5))
        res = load_results(name, storage=url, out=tmp_path)
        err = capsys.readouterr().err
        assert ("chose on the test set" in err) is warned, (name, err)
        notes = "\n".join(table_notes([res]))
        assert ("on the test set, so" in notes) is (note is not None), (name, notes)
        if note is not None:
            assert note in notes, (name, notes)
        assert isinstance(res, StudySet)


def test_the_report_notes_variants_that_trained_different_numbers_of_trials(tmp_path):
    """Rows of variants searched with different trial counts, or whose trials were partly
    pruned before training (over the budget), stood side by side without a word."""
    from kernelstudy.search.report import load_results, table_notes

    url = f"sqlite:///{tmp_path / 'study.db'}"
    over = {"pruned_reason": "feature-map parameters over the budget"}
    runs = {  # name: {variant: (trials trained, trials pruned before training)}
        "even": {"elu": (3, 0), "glu": (3, 2)},
        "uneven": {"elu": (3, 0), "glu": (1, 2)},
    }
    for name, variants in runs.items():
        for label, (n_trained, n_over) in variants.items():
            study = _searched_study(url, f"{name}/{label}")
            for i in range(n_trained):
                study.add_trial(optuna.trial.create_trial(value=0.5 + i / 10))
            for _ in range(n_over):
                study.add_trial(
                    optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED, user_attrs=over)
                )
    notes = "\n".join(table_notes([load_results("even", storage=url, out=tmp_path)]))
    assert "different numbers of trials" not in notes
    notes = "\n".join(table_notes([load_results("uneven", storage=url, out=tmp_path)]))
    assert "tuning was not equal: elu 3, glu 1 (2 more pruned before training)." in notes
    # two workers may finish one trial more than asked (the --trials help): no note
    for name, counts in (("two_workers", {"elu": 3, "glu": 4}), ("beyond", {"elu": 3, "glu": 5})):
        for label, n_trained in counts.items():
            study = _searched_study(url, f"{name}/{label}")
            for _ in range(n_trained):
                trial = optuna.trial.create_trial(value=0.5, user_attrs={"workers": 2})
                study.add_trial(trial)
    notes = "\n".join(table_notes([load_results("two_workers", storage=url, out=tmp_path)]))
    assert "different numbers of trials" not in notes
    notes = "\n".join(table_notes([load_results("beyond", storage=url, out=tmp_path)]))
    assert "tuning was not equal: elu 3, glu 5." in notes


def test_the_train_time_figure_says_how_many_workers_ran_at_once():
    """Trials' training times grow with the workers running beside them (they share the
    cores: 0.25 s alone, 0.6 s beside another), which the cost figure did not say."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from kernelstudy.search.report import figures

    def label(workers: list) -> str:
        rows = pd.DataFrame(
            {"config": "c", "task": "listops", "variant": "elu", "number": range(len(workers)),
             "state": "COMPLETE", "val_accuracy": 0.5, "test_accuracy": 0.5,
             "train_time_s": 1.0, "workers": workers}
        )  # fmt: skip
        figs = figures(rows)
        xlabel = figs["accuracy_vs_train_time"].axes[0].get_xlabel()
        plt.close("all")
        return xlabel

    assert label([1, 1]) == label([None, None]) == "training time (s)"
    assert label([2, 2]) == "training time (s), 2 workers at once"
    assert label([1, 2]) == "training time (s), with 1 or 2 workers at once: not comparable"


def test_the_report_notes_evaluation_runs_of_several_devices_pooled_in_one_mean():
    """evaluation.csv kept no device: a --seeds 3 evaluation on a GPU (bf16 autocast)
    followed by --seeds 5 on the CPU (fp32) pooled into one mean without a word."""
    import pandas as pd

    from kernelstudy.search.report import _mixed_devices

    runs = pd.DataFrame(
        {"variant": ["elu", "elu", "elu", "glu", "glu", "old"],
         "device": ["cuda", "cpu", "cuda", "cpu", "cpu", None],
         "amp": ["bfloat16", None, "bfloat16", None, None, None]}
    )  # fmt: skip
    assert _mixed_devices(runs) == "elu (cpu, cuda bfloat16)"
    one_gpu = runs.assign(device=["cuda", "cuda:0", "cuda", "cpu", "cpu", None], amp="bfloat16")
    assert _mixed_devices(one_gpu[one_gpu["variant"] == "elu"]) == ""  # --device cuda, cuda:0
    assert _mixed_devices(runs[runs["variant"] != "elu"]) == ""
    assert _mixed_devices(runs.drop(columns=["device", "amp"])) == ""  # older files


def test_the_report_notes_variants_searched_under_other_pruners_or_seeds(tmp_path):
    """The pruner and sampler seed steer which trials run; neither was recorded, so variants
    searched under others (a --variant rerun after the config's pruner changed) stood side by
    side without a word."""
    from kernelstudy.search.report import load_results, table_notes
    from kernelstudy.search.runner import SEARCHED_UNDER_ATTR, searched_under

    url = f"sqlite:///{tmp_path / 'study.db'}"
    under = {
        "elu": [{"pruner": "median", "seed": 0}],
        "glu": [{"pruner": "median", "seed": 0}, {"pruner": "none", "seed": 0}],
        "old": None,  # searched before it was recorded: not compared
    }
    for label, runs in under.items():
        study = _searched_study(url, f"s/{label}")
        if runs is not None:
            study.set_user_attr(SEARCHED_UNDER_ATTR, runs)
        study.add_trial(optuna.trial.create_trial(value=0.5))
    res = load_results("s", storage=url, out=tmp_path)
    assert searched_under({k: v for k, v in res.studies.items() if k != "glu"}) == ""
    alike = {label: res.studies["glu"] for label in ("a", "b")}  # one history of two entries
    assert searched_under(alike) == ""
    notes = "\n".join(table_notes([res]))
    assert (
        "different pruners or sampler seeds, which choose the trials that run: elu: pruner "
        "median, seed 0; glu: pruner median, seed 0 then pruner none, seed 0." in notes
    )


def test_a_variant_whose_trials_were_all_refused_says_why(tmp_path):
    """The summary and the report named the reason of over-budget trials only: a variant
    whose every trial the model refused (its first `trials`, drawn from a space whose
    defaults build) read "2 pruned, 0 of them over the budget", with no reason."""
    from kernelstudy.search.report import load_results, table_notes
    from kernelstudy.search.runner import study_row

    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = _searched_study(url, "r/poly")
    why = {"refused_reason": "refused by the model: degree=3 at head_dim=8 gives 512 features"}
    for _ in range(2):
        study.add_trial(
            optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED, user_attrs=why)
        )
    row = study_row(study, "poly")
    assert (row["refused"], row["over_budget"], row["trained"]) == (2, 0, 0)
    assert row["note"] == why["refused_reason"]
    notes = "\n".join(table_notes([load_results("r", storage=url, out=tmp_path)]))
    assert "2 pruned, 0 of them over the budget, 2 refused by the model" in notes
    assert why["refused_reason"] in notes


def test_quick_searches_get_no_paper_numbers(tmp_path):
    """The paper's numbers attached by label and task alone: the quick search's 2-layer
    d_model 32 model on 48-token generated ListOps stood beside the paper's 36.37."""
    from kernelstudy.search.report import load_results, results_table, table_notes

    url = f"sqlite:///{tmp_path / 'study.db'}"
    for name in ("lra_listops", "lra_listops_quick"):
        study = _searched_study(url, f"{name}/Transformer")
        study.add_trial(optuna.trial.create_trial(value=0.3, user_attrs={"test_accuracy": 0.2}))
    full, quick = (
        load_results(n, storage=url, out=tmp_path) for n in ("lra_listops", "lra_listops_quick")
    )
    assert results_table([full]).loc["Transformer", ("listops", "paper")] == 36.37
    assert "Yorsh & Kovalenko's Table 1" in "\n".join(table_notes([full]))
    assert quick.quick and ("listops", "paper") not in results_table([quick]).columns
    assert "Yorsh & Kovalenko's Table 1" not in "\n".join(table_notes([quick]))


@pytest.mark.parametrize("name", ["lra_text", "lra_retrieval", "lra_listops"])
def test_lra_configs_state_the_map_budgets_their_full_models_have(name):
    """The configs' comments give what per-head GLU and AOGLU stacks add to the full-size
    model (the paper's budget remarks); lra_retrieval's gave the text model's numbers."""
    import re
    from pathlib import Path

    from kernelstudy.search.objective import build_model, default_settings

    path = Path(__file__).parents[1] / "studies" / f"{name}.toml"
    text = " ".join(line.lstrip("# ") for line in path.read_text().splitlines())
    stated = re.search(
        r"one GLU unit adds ([\d.]+)% to the parameters, two ([\d.]+)%, three ([\d.]+)%, "
        r"and three AOGLU units ([\d.]+)%",
        text,
    )
    assert stated is not None
    config = load_config(path)

    class Task:  # the sizes the model takes from the task
        vocab_size, num_classes = (16, 10) if name == "lra_listops" else (257, 2)
        pairs = name == "lra_retrieval"
        max_length = config.task_options["max_length"]

    extra = []
    for label in ("1xGLU", "2xGLU", "3xGLU", "3xAOGLU"):
        variant = config.variant(label)
        _, sizes = build_model(config, variant, default_settings(config, variant), Task())
        extra.append(f"{sizes['feature_map_extra']:.1%}")
    assert [f"{float(x):.1f}%" for x in stated.groups()] == extra


def test_lras_listops_recipe_can_be_set_in_the_shipped_config(tmp_path):
    """The README says how LRA's fixed ListOps recipe is written in a config: Adam(W) with
    beta2 0.98, weight decay 0.1, and 0.05 × linear warm-up × 1/sqrt(max(step, 1000)). Its
    learning rate at every step is LRA's at the next (LRA counts from step 0 at rate 0)."""
    import math
    import re
    from pathlib import Path

    from kernelstudy.search.objective import default_settings
    from kernelstudy.train.schedule import WarmupDecay

    text = (Path(__file__).parents[1] / "studies" / "lra_listops.toml").read_text()
    text = text.replace("[train]\n", "[train]\nbetas = [0.9, 0.98]\n", 1).replace(
        'schedule = "cosine"', 'schedule = "inverse_sqrt"', 1
    )
    text = re.sub(
        r"\n\[search\]\n",
        "\n[space]\nlr = 1.58e-3\nweight_decay = 0.1\nwarmup_fraction = 0.2\n\n[search]\n",
        text,
        count=1,
    )
    path = tmp_path / "lra_listops_recipe.toml"
    path.write_text(text)
    config = load_config(path)
    variant = config.variant("elu+1")
    train = default_settings(config, variant).train_config(config, seed=0, device="cpu")
    assert (train.betas, train.weight_decay, train.warmup_steps) == ((0.9, 0.98), 0.1, 1000)
    rate = WarmupDecay(train.schedule, train.warmup_steps, train.steps)
    for step in (0, 499, 999, 1000, 2500, 4999):
        lra = 0.05 * min(1.0, (step + 1) / 1000) / math.sqrt(max(step + 1, 1000))
        assert math.isclose(train.lr * rate(step), lra, rel_tol=1e-3), step


def test_configs_of_one_name_generate_into_folders_of_their_own(tmp_path):
    """Generated data lived in OUT/NAME/data whatever the [generate] table: a search of a
    changed table (run with another --storage, as the refusal says) rewrote the files a
    search of the first one was training on at the time, and the stamp could end up
    naming the other table's files. A folder per table: neither touches the other's."""
    from kernelstudy.search.objective import data_dir, prepare_data

    def config(generate: str):
        text = GOOD.replace('data = "data"', "") + "[generate]\n" + generate
        return load_config(_write(tmp_path, text))

    small = "n_train = 8\nn_val = 4\nn_test = 4\nmin_length = 10\nmax_length = 40\n"
    a, b = config(small), config(small.replace("n_train = 8", "n_train = 12"))
    reordered = config("max_length = 40\n" + small.replace("max_length = 40\n", ""))
    out = tmp_path / "out"
    assert data_dir(a, out) == data_dir(reordered, out) != data_dir(b, out)
    assert data_dir(a, out).parent == data_dir(b, out).parent == out / "tiny"
    first = prepare_data(a, out) / "basic_train.tsv"
    before = first.read_bytes()
    second = prepare_data(b, out) / "basic_train.tsv"
    assert first.read_bytes() == before and len(second.read_text().splitlines()) == 13
    stamp = first.read_bytes(), (first.parent / "generate.json").read_text()
    assert prepare_data(a, out) / "basic_train.tsv" == first  # reused, not written again
    assert (first.read_bytes(), (first.parent / "generate.json").read_text()) == stamp


def test_searches_write_where_the_studies_and_notebooks_read(tmp_path, monkeypatch):
    """search, evaluate and report wrote to ./results of the working directory whatever
    $KERNELSTUDY_RESULTS said, and lra_results.ipynb, reading results_dir(), found nothing
    and ran a search of its own. Without out, they use the studies' results folder."""
    from kernelstudy.search.evaluate import evaluation_path
    from kernelstudy.search.runner import searched_storage_url, storage_url
    from kernelstudy.study import results_dir

    cfg = load_config(_write(tmp_path, GOOD))
    monkeypatch.setenv("KERNELSTUDY_RESULTS", str(tmp_path / "mine"))
    monkeypatch.chdir(tmp_path)
    assert results_dir() == tmp_path / "mine"
    assert storage_url(cfg, None) == f"sqlite:///{tmp_path / 'mine' / 'tiny' / 'optuna.db'}"
    assert evaluation_path(cfg) == tmp_path / "mine" / "tiny" / "evaluation.csv"
    with pytest.raises(FileNotFoundError, match=r"run `kernelstudy search \S+cfg\.toml` first"):
        searched_storage_url(cfg, None)  # the command needs no --out to find it
    with pytest.raises(FileNotFoundError, match=r"--out other"):
        searched_storage_url(cfg, None, "other")
    assert not (tmp_path / "results").exists()
    # a studies folder of one's own that holds no study yet: searches run none
    (tmp_path / "mystudies").mkdir()
    monkeypatch.setenv("KERNELSTUDY_STUDIES_DIR", str(tmp_path / "mystudies"))
    monkeypatch.delenv("KERNELSTUDY_RESULTS")
    assert evaluation_path(cfg) == tmp_path / "results" / "tiny" / "evaluation.csv"


def test_the_hints_to_search_first_are_commands_that_run(tmp_path):
    """evaluate and report said "run `kernelstudy search` first": as printed, argparse's
    "the following arguments are required: CONFIG"; the config, --quick, --out, --storage
    and the variants missing are in the hint now."""
    from kernelstudy.search import run_evaluation, write_report

    text = GOOD.replace('data = "data"', "") + (
        "[generate]\nn_train = 8\nn_val = 4\nn_test = 4\nmin_length = 10\nmax_length = 40\n"
    )
    cfg = load_config(_write(tmp_path, text))
    url = f"sqlite:///{tmp_path / 'other.db'}"
    optuna.create_study(storage=url, study_name="elsewhere/x")
    with pytest.raises(ValueError, match=r"run `kernelstudy search \S+cfg\.toml --out \S+ "
                       r"--storage sqlite:///\S+other\.db --variant elu` first"):  # fmt: skip
        run_evaluation(cfg, storage=url, out=tmp_path / "out", variants=["elu"])
    with pytest.raises(ValueError, match=r"run `kernelstudy search \S+cfg\.toml --out \S+ --st"):
        write_report([cfg.path], storage=url, out=tmp_path / "out")


def test_a_bare_name_of_a_shipped_config_is_pointed_to_its_file(tmp_path, monkeypatch):
    """`kernelstudy search lra_listops` said only "search config lra_listops does not exist";
    a bare name of a config in the studies folder is pointed to that file (not a path with a
    folder or a suffix, nor a name no config has). A study name given to ``report`` with
    ``--quick``, which only a config file's [quick] table gives meaning, was looked up as the
    full search's and the hint suggested --storage; it is refused, naming the quick name."""
    from kernelstudy.folders import studies_dir
    from kernelstudy.search.report import load_results

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="did you mean .*lra_listops.toml") as err:
        load_config("lra_listops")
    assert str(studies_dir() / "lra_listops.toml") in str(err.value)
    for other in ("no_such_search", "sub/lra_listops", "lra_listops.toml"):
        with pytest.raises(FileNotFoundError) as err:
            load_config(other)
        assert "did you mean" not in str(err.value), other
    with pytest.raises(ValueError, match="'lra_listops_quick' in the studies' configs"):
        load_results("lra_listops", out=tmp_path, quick=True)
    with pytest.raises(FileNotFoundError, match="did you mean .*lra_listops.toml"):
        load_results("lra_listops", out=tmp_path)  # no study of that name: report's hint too
