"""Which code produced a result: the package version and, run from a git checkout, its commit
(the version alone names every commit of the project alike)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def checkout_commit() -> str | None:
    """The commit of the checkout this package runs from, as ``git describe --always
    --dirty`` gives it with every tag excluded (a 12-digit hash, ``-dirty`` when tracked
    files differ from it), read at each call (a notebook's later study after a commit);
    None for an installed package, without git, or when git fails (within 10 s)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        run = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "describe",
                "--always",
                "--dirty",
                "--abbrev=12",
                "--exclude=*",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    described = run.stdout.strip()
    return described if run.returncode == 0 and described else None


def with_commit(version: str) -> str:
    """``version`` (kernelstudy's), with ``+git.<commit>`` when :func:`checkout_commit` knows
    it (``0.1.0+git.45b4db8c1234.dirty``: a PEP 440 local version)."""
    commit = checkout_commit()
    return version if commit is None else f"{version}+git.{commit.replace('-', '.')}"
