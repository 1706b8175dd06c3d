"""examples/rl_weight_sync runs as its README shows: the README's blocks are the script's, at most 15 lines a side,
and the script, copied out of the checkout, trains, publishes, syncs and serves at small sizes, printing every
step's seconds and bytes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_weight_sync"


def test_the_readme_shows_each_side_in_at_most_15_lines():
    script = (EXAMPLE / "rl_loop.py").read_text()
    blocks = dict(re.findall(r"# -- README begins: (\w+)\n(.*?)    # -- README ends\n", script, re.S))
    assert set(blocks) == {"trainer", "serving"}
    readme = (EXAMPLE / "README.md").read_text()
    for side, block in blocks.items():
        assert len(block.strip().splitlines()) <= 15, side
        assert f"```python\n{textwrap.dedent(block)}```" in readme, side


@pytest.mark.slow  # six ranks importing torch and transformers: about 90 s on two shared cores
def test_the_example_runs_from_a_copy_and_prints_every_step(tmp_path):
    pytest.importorskip("transformers", reason="the example trains a transformers model: pip install 'reshard[dev]'")
    shutil.copytree(EXAMPLE, tmp_path / "rl_weight_sync")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_")}
    out = subprocess.run([sys.executable, str(tmp_path / "rl_weight_sync" / "rl_loop.py"), "--steps", "2",
                          "--hidden", "64", "--layers", "2", "--vocab", "130"],
                         capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    steps = re.findall(r"^step (\d): publish [\d.]+ s, sync [\d.]+ s \(([\d,]+) bytes over the network, grpc\), "
                       r"read into the standby [\d.]+ s, (\d+) generations during the sync and the read, serving "
                       r"paused ([\d.]+) s \(the swap\)$", out.stdout, re.M)
    assert [s[0] for s in steps] == ["1", "2"], out.stdout
    assert all(int(s[1].replace(",", "")) > 0 and int(s[2]) >= 1 for s in steps)
    # Serving pauses only for the swap, a reference assignment: far under a millisecond (the read took ~0.1 s)
    assert all(float(s[3]) < 0.001 for s in steps), steps
    assert "tokens from step 2's weights: [1, 5, 9, 2, 7, 3, " in out.stdout
