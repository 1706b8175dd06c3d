"""The README's Python examples run as written."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_shows_the_two_commands_first():
    text = README.read_text()
    first_block = text.split("```", 2)[1]
    assert "make demo" in first_block and "make test" in first_block


def test_readme_planning_example_runs():
    block = next(b for b in python_blocks() if "reshard.plan(" in b)
    out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "auto: int32[1024,1024,512] P(None, 'x', None) -> P('x', None, None)" in out.stdout
    assert "lower bound" in out.stdout and "send MiB" in out.stdout


def test_readme_quickstart_is_the_tested_file():
    """tests/integration/test_packaging.py runs docs/quickstart.py; the README shows exactly that file."""
    quickstart = (README.parent / "docs" / "quickstart.py").read_text()
    assert quickstart in python_blocks()
