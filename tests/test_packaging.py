"""An installed package works outside the checkout: it carries the kernels' sources and the
studies, finds them whatever the install scheme, and builds with the tools it installs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import types
import zipfile
from pathlib import Path

import pytest

from kernelstudy import study
from kernelstudy.core import extensions

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _tracked(folder: str) -> set[str]:
    """Files under REPO/folder that the package must carry (results and caches excluded)."""
    root = REPO / folder
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and "results" not in p.parts and "__pycache__" not in p.parts
    }


def test_the_package_list_names_every_package_and_the_mapped_folders_exist():
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "kernelstudy").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    mapped = SETUPTOOLS["package-dir"]
    assert set(SETUPTOOLS["packages"]) == found | set(mapped)
    assert all((REPO / folder).is_dir() for folder in mapped.values())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built offline from a copy of the sources (the build writes beside them)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "results", "*.egg-info")
    for name in ("kernelstudy", "csrc", "studies"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    dist = tmp_path_factory.mktemp("dist")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    run = subprocess.run(
        [*command, "--no-index", "-q", "-w", str(dist), str(src)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = dist.glob("kernelstudy-*.whl")
    return path


@pytest.mark.slow
def test_the_wheel_carries_the_kernel_sources_the_studies_and_the_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, inside in (("csrc", "_csrc"), ("studies", "_studies")):
        carried = {n.removeprefix(f"kernelstudy/{inside}/") for n in names}
        assert _tracked(folder) <= carried, _tracked(folder) - carried
    assert not any(n.startswith(("tests/", "csrc/", "studies/", "notebooks/")) for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "kernelstudy/py.typed" in names


@pytest.mark.slow
def test_an_installed_package_finds_its_sources_and_studies_outside_the_checkout(wheel, tmp_path):
    """As pip lays out a pure wheel (--user, --prefix and --target differ only in the folder),
    beside an unrelated top-level ``csrc`` folder, run from a folder that is no checkout."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    (site / "csrc").mkdir()  # another distribution's folders: not taken for ours
    (site / "studies").mkdir()
    (site / "studies" / "other.toml").write_text("x = 1\n")
    here = tmp_path / "work"
    here.mkdir()
    code = (
        "import json\n"
        "from kernelstudy import study\n"
        "from kernelstudy.core import extensions\n"
        "print(json.dumps({'csrc': str(extensions.csrc_dir()), 'studies': study.list_studies(),"
        " 'dir': str(study.studies_dir()), 'results': str(study.results_dir()),"
        " 'rank': study.load_study('rank').__file__}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELSTUDY_")}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert got["csrc"] == str(site / "kernelstudy" / "_csrc")
    assert got["dir"] == str(site / "kernelstudy" / "_studies")
    assert got["studies"] == study.list_studies()
    assert got["rank"] == str(site / "kernelstudy" / "_studies" / "rank.py")
    assert got["results"] == str(here / "results")  # not inside site-packages


def test_a_checkout_uses_its_own_folders(monkeypatch):
    monkeypatch.delenv(study.ENV_STUDIES_DIR, raising=False)
    monkeypatch.delenv(study.ENV_RESULTS_DIR, raising=False)
    assert extensions.csrc_dir() == REPO / "csrc"
    assert study.studies_dir() == REPO / "studies"
    assert study.results_dir() == REPO / "results"


def test_the_ninja_package_is_put_on_path_for_the_build_when_none_is_there(monkeypatch, tmp_path):
    """A venv's python run without activating it: the ninja that pip installed is not on PATH,
    and torch's build, which runs ``ninja`` from PATH, said to install it."""
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR=str(tmp_path)))
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    before = os.environ.get("PATH")
    with extensions._ninja_on_path():
        assert os.environ["PATH"].split(os.pathsep)[0] == str(tmp_path)
    assert os.environ.get("PATH") == before
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: "/usr/bin/ninja")
    with extensions._ninja_on_path():  # one on PATH already: PATH as it was
        assert os.environ.get("PATH") == before


def test_the_checkout_tracks_only_the_project_layout_at_its_top_level():
    """A run's output folder committed by mistake (a ``--out`` at the top, once ``cc/``) fails."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    top = {name.split("/", 1)[0] for name in listed.split("\0") if name}
    layout = {"kernelstudy", "csrc", "studies", "tests", "notebooks", "benchmarks"}
    files = {"pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", ".gitignore", ".ci"}
    assert top <= layout | files, (
        f"unexpected top-level entries tracked: {sorted(top - layout - files)}"
    )


def test_results_name_the_commit_of_a_checkout(monkeypatch):
    """Every study provenance line and benchmark CSV said "kernelstudy 0.1.0", the version of
    every commit alike: results made by code since changed could not be told apart. In a
    checkout the version carries the commit (``+git.<hash>``, ``.dirty`` when files differ)."""
    from kernelstudy import revision

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    version = revision.with_commit("0.1.0")
    assert version.startswith(f"0.1.0+git.{head[:12]}"), version
    assert f"kernelstudy {version}," in study.provenance("toy", True, "cpu")
    monkeypatch.setenv("PATH", "")  # no git: the version alone
    assert revision.with_commit("0.1.0") == "0.1.0"


def test_a_commit_is_dirty_where_its_code_differs_not_its_results(tmp_path):
    """A second study run into the tracked studies/results was labelled ``.dirty`` by the
    first run's rows (git describe --dirty counts every tracked file): a result's commit is
    dirty where the code differs (the package, csrc, studies' scripts and configs,
    benchmarks' scripts, pyproject.toml), not its results, docs or tests."""
    from kernelstudy import revision

    if shutil.which("git") is None:
        pytest.skip("no git")
    files = {
        "kernelstudy/core.py": "x = 1\n",
        "studies/rank.toml": "seeds = 3\n",
        "studies/results/rank/results.csv": "a\n1\n",
        "benchmarks/results/cuda.csv": "a\n1\n",
        "README.md": "# k\n",
        "tests/test_x.py": "\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    def git(*args: str) -> str:
        who = ["-c", "user.name=k", "-c", "user.email=k@k", "-c", "commit.gpgsign=false"]
        return subprocess.run(
            ["git", *who, *args], cwd=tmp_path, capture_output=True, text=True, check=True
        ).stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "first")
    head = git("rev-parse", "HEAD")[:12]
    assert revision.checkout_commit(tmp_path) == head
    for name in ("studies/results/rank/results.csv", "benchmarks/results/cuda.csv", "README.md",
                 "tests/test_x.py"):  # fmt: skip
        (tmp_path / name).write_text("changed\n")
    assert revision.checkout_commit(tmp_path) == head
    for name in ("kernelstudy/core.py", "studies/rank.toml"):
        (tmp_path / name).write_text("changed\n")
        assert revision.checkout_commit(tmp_path) == f"{head}-dirty", name
        git("checkout", "--", name)
    assert revision.checkout_commit(tmp_path / "kernelstudy") is None  # not a checkout's root
