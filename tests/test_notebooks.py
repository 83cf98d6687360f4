"""The notebooks under ``notebooks/``: each one runs top to bottom without an error (nbclient),
and each is stored without outputs.

The notebooks read study results from ``$KERNELSTUDY_RESULTS`` and run the quick study
themselves when a results table is missing. Here that directory is one temporary directory for
the whole session, seeded with the committed full-size results under ``studies/results/``
except those of ``approximation`` (so that notebook exercises the run-the-quick-study path,
and every quick study runs at most once however many notebooks read it).
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {"feature_maps", "approximation", "rank", "speed", "lra_results"}
COMMITTED_RESULTS = REPO / "studies" / "results"
RUN_FRESH = {"approximation"}  # results left out, so its notebook runs the quick study
KERNEL_NAME = "kernelstudy-tests"  # a kernel on this interpreter, whatever else is installed
CELL_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def kernel_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Jupyter data directory holding a kernel spec that runs ``sys.executable``."""
    root = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(
        root / "kernels" / KERNEL_NAME,
        overrides={"display_name": f"kernelstudy tests ({sys.executable})"},
    )
    return root


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``$KERNELSTUDY_RESULTS`` of every notebook in the session (quick studies run once); a
    ``?`` in its name, which SQLAlchemy reads as a URL's query unless the path is encoded."""
    root = tmp_path_factory.mktemp("results?")
    if COMMITTED_RESULTS.is_dir():
        for study in COMMITTED_RESULTS.iterdir():
            if study.is_dir() and study.name not in RUN_FRESH:
                shutil.copytree(study, root / study.name)
    return root


@pytest.fixture(scope="session")
def ipython_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ipython")


@pytest.fixture(autouse=True)
def _own_ipython_dir(ipython_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' profile and history go to the session's folder: each executed cell
    went into the user's ``~/.ipython`` history (one SQLite file for every xdist worker)."""
    monkeypatch.setenv("IPYTHONDIR", str(ipython_dir))


def _ids(path: Path) -> str:
    return path.stem


@pytest.fixture
def figures_not_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel on matplotlib's Agg backend, not the inline one: figures are made (seaborn
    lays them out) but not drawn to PNG, a third of a plotting notebook's time. For the tests
    of what the notebooks do with other results; test_notebook_runs draws every figure."""
    monkeypatch.setenv("MPLBACKEND", "agg")


def _execute(path: Path, work: Path) -> tuple[nbformat.NotebookNode, str]:
    """Run notebook ``path`` in a fresh kernel with working directory ``work``; the executed
    notebook and all it printed. Raises CellExecutionError (with the traceback) on an error."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(work)}},
        extra_arguments=["--HistoryManager.enabled=False"],
    )
    client.execute()
    printed = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    return nb, printed


def test_the_notebooks_are_there() -> None:
    assert EXPECTED <= {p.stem for p in NOTEBOOKS}, f"notebooks found: {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_stored_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code cells"
    for i, cell in enumerate(code):
        assert cell.get("outputs") == [], f"{path.name}: code cell {i} is stored with outputs"
        assert cell.get("execution_count") is None, (
            f"{path.name}: code cell {i} is stored with execution count "
            f"{cell.get('execution_count')}"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_imports_only_public_names(path: Path) -> None:
    """No notebook reaches into a private module or name of kernelstudy."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        source = "\n".join(
            line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))
        )
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "kernelstudy":
                    private = [part for part in name.split(".") if part.startswith("_")]
                    assert not private, f"{path.name} imports a private name: {name}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_runs(
    path: Path,
    kernel_path: Path,
    results_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Execute every cell in a fresh kernel, in an empty working directory; any error fails."""
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_path))
    monkeypatch.setenv("KERNELSTUDY_RESULTS", str(results_dir))
    monkeypatch.setenv("KERNELSTUDY_STUDIES_DIR", str(REPO / "studies"))
    nb, _ = _execute(path, tmp_path)
    skipped = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and not c.execution_count]
    assert not skipped, f"{path.name}: cells {skipped} did not run"


# Results as runs limited with --only leave them: {study: {table: (column, kept values)}},
# one part and then the other.
PARTIAL = [
    {
        "rank": {"results": ("part", {"gaussian"}), "spectra": ("part", {"gaussian"})},
        "approximation": {"results": ("part", {"performer"})},
        "generation": {"results": ("run", {"linear, RNN state"})},
    },
    {
        "rank": {"results": ("part", {"copy"}), "spectra": ("part", {"copy"})},
        "approximation": {"results": ("part", {"maps"})},
        "generation": {"results": ("run", {"softmax, KV cache"})},
    },
]


@pytest.mark.slow
@pytest.mark.parametrize("part", [0, 1], ids=["first_part", "other_part"])
@pytest.mark.parametrize("name", ["rank", "approximation", "speed"])
@pytest.mark.usefixtures("figures_not_drawn")
def test_notebook_runs_on_partial_results(
    name: str, part: int, kernel_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The studies' summaries say "Not run yet" for a part left out with --only; the
    notebooks used to fail on such results (KeyError 'step', a missing 'stage' column, no
    tokens_per_s rows of a run)."""
    import pandas as pd

    results = tmp_path / "results"
    for study, tables in PARTIAL[part].items():
        shutil.copytree(COMMITTED_RESULTS / study, results / study)
        for table, (column, kept) in tables.items():
            path = results / study / f"{table}.csv"
            frame = pd.read_csv(path, dtype={"config_id": str}, low_memory=False)
            frame[frame[column].isin(kept)].to_csv(path, index=False)
    shutil.copytree(COMMITTED_RESULTS / "speed", results / "speed")
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_path))
    monkeypatch.setenv("KERNELSTUDY_RESULTS", str(results))
    monkeypatch.setenv("KERNELSTUDY_STUDIES_DIR", str(REPO / "studies"))
    work = tmp_path / "work"
    work.mkdir()
    _, printed = _execute(NOTEBOOK_DIR / f"{name}.ipynb", work)
    assert "Not run yet" in printed or "Not enough runs" in printed


def _on_both_devices(folder: Path, study: str) -> None:
    """Add a copy of every row of ``folder/results.csv`` as if run with ``--device cuda``."""
    import pandas as pd

    from kernelstudy.study import config_id, load_params, load_study

    module = load_study(study)
    cuda_id = {
        config_id(c, "cpu"): config_id(c, "cuda")
        for quick in (True, False)
        for c in module.configs(load_params(study, quick))
    }
    frame = pd.read_csv(folder / "results.csv", dtype={"config_id": str}, low_memory=False)
    cuda = frame.assign(device="cuda", config_id=frame["config_id"].map(cuda_id))
    pd.concat([frame, cuda], ignore_index=True).to_csv(folder / "results.csv", index=False)


def _of_an_earlier_config(folder: Path, study: str) -> None:
    """Make every row of ``folder/results.csv`` one of a configuration the study no longer
    has (its config was edited since): load_results leaves them all out."""
    import pandas as pd

    frame = pd.read_csv(folder / "results.csv", dtype={"config_id": str}, low_memory=False)
    frame.assign(config_id="0" + frame["config_id"].str[1:]).to_csv(
        folder / "results.csv", index=False
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "printed"),
    [
        (_on_both_devices, ["RNN-mode speed-up on cpu", "RNN-mode speed-up on cuda"]),
        (_of_an_earlier_config, ["Not run yet: the generation study"]),
    ],
    ids=["two_devices", "no_current_rows"],
)
@pytest.mark.usefixtures("figures_not_drawn")
def test_speed_notebook_on_other_results(
    change, printed: list[str], kernel_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The speed notebook groups its rows by device, but load_results refuses rows of two
    devices without device=: after `kernelstudy study speed --device cuda` beside the CPU
    run it failed at its first cell; a generation table with no current rows failed with
    "line_plot: frame is empty"."""
    results = tmp_path / "results"
    for study in ("speed", "generation"):
        shutil.copytree(COMMITTED_RESULTS / study, results / study)
        change(results / study, study)
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_path))
    monkeypatch.setenv("KERNELSTUDY_RESULTS", str(results))
    monkeypatch.setenv("KERNELSTUDY_STUDIES_DIR", str(REPO / "studies"))
    work = tmp_path / "work"
    work.mkdir()
    _, text = _execute(NOTEBOOK_DIR / "speed.ipynb", work)
    for line in printed:
        assert line in text


@pytest.mark.slow
def test_lra_notebook_runs_no_search_in_a_given_storage(
    kernel_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With KERNELSTUDY_STORAGE set, the notebook reads the full config's studies; where the
    storage had none (a mistyped URL) it started a full-size search there (3 trials of each
    headline variant, 6 layers at length 2000), or failed asking for the LRA data."""
    from nbclient.exceptions import CellExecutionError

    storage = f"sqlite:///{tmp_path / 'empty.db'}"
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_path))
    monkeypatch.setenv("KERNELSTUDY_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("KERNELSTUDY_STORAGE", storage)
    monkeypatch.setenv("KERNELSTUDY_STUDIES_DIR", str(REPO / "studies"))
    with pytest.raises(CellExecutionError, match="holds no study lra_listops/"):
        _execute(NOTEBOOK_DIR / "lra_results.ipynb", tmp_path)
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("figures_not_drawn")
def test_rank_notebook_fills_spectra_beside_full_results_without_rewriting_them(
    kernel_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given full results without spectra.csv, the rank notebook filled the spectra by running
    the quick study into that folder: the full run's summary.md and figures were replaced by
    the quick run's (and results.csv got the quick-only configurations' rows)."""
    folder = tmp_path / "results" / "rank"
    shutil.copytree(COMMITTED_RESULTS / "rank", folder)
    (folder / "spectra.csv").unlink()
    kept = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix in (".csv", ".md", ".png")}
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_path))
    monkeypatch.setenv("KERNELSTUDY_RESULTS", str(folder.parent))
    monkeypatch.setenv("KERNELSTUDY_STUDIES_DIR", str(REPO / "studies"))
    work = tmp_path / "work"
    work.mkdir()
    _execute(NOTEBOOK_DIR / "rank.ipynb", work)
    for name, data in kept.items():
        assert (folder / name).read_bytes() == data, f"{name} was rewritten"
    assert (folder / "spectra.csv").is_file()
