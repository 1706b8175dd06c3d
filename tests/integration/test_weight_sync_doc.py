"""The README's weight-sync example runs as written: docs/weight_sync.py as two torchrun jobs against real agents."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.client.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "weight_sync.py"


def _block(text: str) -> str:
    return re.search(r"# -- README begins\n(.*?)# -- README ends\n", text, re.S).group(1)


def test_the_readme_shows_the_script_s_block():
    block = _block(SCRIPT.read_text())
    assert len(block.strip().splitlines()) <= 12
    assert f"```python\n{block}```" in (ROOT / "README.md").read_text()


def _torchrun(role: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT), role], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


@pytest.mark.slow  # two torchrun jobs of two ranks (15 s): make bench runs it; the README's block is checked above
def test_training_ranks_publish_and_inference_ranks_read_in_their_layout():
    # The example is the same on either transport; on gRPC no agent (nor the planner) imports torch to form a
    # process group, which saves this test seconds of make test's 10 minutes (the collective path of
    # reshard_many runs in test_reshard_many.py and bench/weight_sync.py).
    with LocalCluster(4, 1, transport="grpc") as cluster:
        env = {**os.environ, "RESHARD_PLANNER": cluster.address, "RESHARD_TOKEN": cluster.token,
               "OMP_NUM_THREADS": "1"}
        train = _torchrun("train", env)
        assert train.returncode == 0, train.stderr[-3000:]
        with cluster.connect() as c:
            held = {t.name: t for t in c.tensors()}
            assert len(held) == 16 and {str(t.sharding.mesh.hosts) for t in held.values()} == {"('host0', 'host1')"}
            before = {name: t.version for name, t in held.items()}
        serve = _torchrun("serve", env)
        assert serve.returncode == 0, serve.stderr[-3000:]
        assert serve.stdout.count("16 weights read bit-exact in the serving layout") == 2, serve.stdout
        with cluster.connect() as c:
            after = {t.name: t for t in c.tensors()}
            # one reshard_many: every weight moved to the serving hosts, each one version on
            assert {str(t.sharding.mesh.hosts) for t in after.values()} == {"('host2', 'host3')"}
            assert {name: t.version for name, t in after.items()} == {n: v + 1 for n, v in before.items()}
