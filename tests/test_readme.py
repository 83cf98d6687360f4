"""The README's two commands and its usage example stay true."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_opens_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    main_job, tests = blocks[0].strip(), blocks[1].strip()
    assert "kernelstudy study approximation --quick" in main_job
    assert '.[test]"' in tests and "pytest" in tests


def test_readme_usage_example_runs():
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["out"].shape == namespace["exact"].shape
