"""The README stays true: its two commands, its examples, its commands and its map table."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import kernelstudy as ks
from kernelstudy.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", TEXT, re.S)


def test_readme_opens_with_the_two_commands():
    blocks = _blocks("bash")
    main_job, tests = blocks[0].strip(), blocks[1].strip()
    assert "kernelstudy study approximation --quick" in main_job
    assert '.[test]"' in tests and "pytest" in tests


@pytest.mark.slow
def test_readme_python_examples_run(tmp_path):
    """Every python block, in order, in one fresh interpreter (the map-adding example
    registers a map, which must not leak into this process's registry)."""
    code = "\n\n".join(_blocks("python"))
    code += (
        "\nassert out.shape == exact.shape\n"
        "assert 'softplus_beta' in ks.list_feature_maps()\n"
        "m = ks.create_feature_map('softplus_beta', head_dim=8, beta=2.0)\n"
        "assert m(torch.randn(1, 1, 4, 8)).min() > 0\n"
        # the learned-map example: seeded, and every float dtype through the core
        "r = ks.create_feature_map('relu2', head_dim=8, hidden_dim=6, seed=3)\n"
        "assert torch.equal(r.weight, ks.create_feature_map('relu2', head_dim=8, "
        "hidden_dim=6, seed=3).weight)\n"
        "for dt in (torch.bfloat16, torch.float16, torch.float64):\n"
        "    x = torch.randn(1, 2, 5, 8, dtype=dt)\n"
        "    y = ks.kernel_attention(x, x, x, feature_map=r, causal=True)\n"
        "    assert y.dtype == dt and torch.isfinite(y).all()\n"
        # its F as `kernelstudy maps` lists it (the example said D)
        "t = ks.feature_maps.feature_map_table().set_index('name')\n"
        "assert t.loc['relu2', 'feature_dim'] == 'hidden_dim', t.loc['relu2']\n"
    )
    script = tmp_path / "readme_examples.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _commands() -> list[str]:
    """Every ``kernelstudy ...`` command line in the README's bash blocks."""
    lines = []
    for block in _blocks("bash"):
        block = block.replace("\\\n", " ")
        for line in block.splitlines():
            for part in line.split("&&"):
                part = part.split("#")[0].strip()
                if part.startswith("kernelstudy "):
                    lines.append(part)
    return lines


def test_readme_commands_parse():
    """Each command the README shows names a subcommand and options the CLI has."""
    commands = _commands()
    assert len(commands) >= 5
    parser = build_parser()
    for line in commands:
        args = parser.parse_args(shlex.split(line)[1:])
        assert getattr(args, "func", None) is not None, line


def test_readme_lists_every_registered_map():
    section = TEXT.split("## Feature maps", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    table = re.findall(r"^\| `([a-z_0-9]+)` \|", section, re.M)
    registered = ks.list_feature_maps()
    missing, extra = sorted(set(registered) - set(table)), sorted(set(table) - set(registered))
    assert not missing, f"add a row for {missing} to the README's '## Feature maps' table"
    assert not extra, f"the README's '## Feature maps' table lists unregistered maps {extra}"
    assert len(table) == len(set(table)), "a map has two rows in the README's table"
