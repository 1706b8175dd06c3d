"""docs/mlp.py trains the Mesh-TensorFlow MLP through c.einsum and c.apply on 4 real agents; its losses must
match a one-process numpy run after every step (the script checks to 1e-5 relative and exits non-zero)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# 8-10 s, most of it the example starting its own cluster: in the slow suite (make bench), which keeps make test
# under its 10 minutes; the same einsum and apply calls run in make test's own einsum and pipeline tests.
@pytest.mark.slow
def test_the_mlp_example_trains_and_matches_numpy():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "mlp.py"), "--steps", "10"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)$", proc.stdout, re.M)]
    assert len(losses) == 10 and losses[-1] < losses[0] / 3, proc.stdout  # 2.53 -> 0.74 at lr's default
    assert "matches numpy" in proc.stdout
