"""`make gpu-check` where there is no GPU: both scripts skip saying why, their arguments, the pytest summary they read,
the table and verdict they end with, and the Makefile's install line for a Python without network.

The GPU run itself (the CUDA tests and the bench's figures) is `make gpu-check` on a CUDA host; these run on CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_gpu_check():
    """bench/gpu_check.py, and bench/gpu.py as it imports it, leaving this process's sys.path and modules as they
    were (bench/ holds modules named like common words: transport, pipeline)."""
    path, had_gpu = list(sys.path), "gpu" in sys.modules
    spec = importlib.util.spec_from_file_location("bench_gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
        if not had_gpu:
            sys.modules.pop("gpu", None)
    return module


gpu_check = _load_gpu_check()
gpu = gpu_check.gpu

no_gpu_here = pytest.mark.skipif(gpu.no_cuda_reason() is None,
                                 reason="torch sees a CUDA device here: make gpu-check runs the real thing")


@no_gpu_here
def test_gpu_check_skips_saying_torch_sees_no_cuda_device(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--log", str(tmp_path / "logs")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("gpu-check skipped: ") and "sees no CUDA device" in out.stdout
    assert not (tmp_path / "logs").exists()  # nothing ran, so no logs


@no_gpu_here
def test_gpu_check_fails_without_a_gpu_where_one_is_required(capsys):
    # main() in this process: the script's own start (a torch import, 3 s here) is the test above's
    assert gpu_check.main(["--require-gpu"]) == 1
    assert "gpu-check FAILED (--require-gpu): " in capsys.readouterr().out


@no_gpu_here
def test_gpu_bench_skips_and_its_json_says_so(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert gpu.main(["--json", str(path)]) == 0
    out = capsys.readouterr().out
    reason = out.removeprefix("skipped: ").strip()
    assert out.startswith("skipped: ") and "sees no CUDA device" in reason
    assert json.loads(path.read_text()) == {"skipped": reason}


def test_arguments_and_their_defaults():
    args = gpu_check.parse_args([])
    assert (args.log, args.budget_s, args.mib, args.small_mib, args.repeats, args.device, args.require_gpu) == (
        Path("gpu-check-logs"), 450.0, 4096, 256, 5, "cuda:0", False)
    args = gpu_check.parse_args(["--log", "/tmp/x", "--mib", "64", "--small-mib", "0", "--budget-s", "60"])
    assert (args.log, args.mib, args.small_mib, args.budget_s) == (Path("/tmp/x"), 64, 0, 60.0)

    bench = gpu.parse_args([])
    assert (bench.mib, bench.small_mib, bench.repeats, bench.device, bench.json) == (4096, 256, 5, "cuda:0", None)
    assert gpu.sizes_mib(bench) == [4096, 256]
    assert gpu.sizes_mib(gpu.parse_args(["--mib", "256", "--json", "g.json"])) == [256]
    assert gpu.sizes_mib(gpu.parse_args(["--small-mib", "0"])) == [4096]


@pytest.mark.parametrize("argv, message", [
    (["--mib", "0"], "argument --mib: must be a whole number above 0, got 0"),
    (["--repeats", "-1"], "argument --repeats: must be a whole number above 0, got -1"),
    (["--small-mib", "-5"], "argument --small-mib: must be a whole number of MiB, 0 to leave the size out, got -5"),
])
def test_bad_sizes_are_refused_naming_the_rule(argv, message, capsys):
    for parse in (gpu.parse_args, gpu_check.parse_args):
        with pytest.raises(SystemExit) as e:
            parse(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--budget-s", "0"])
    assert "argument --budget-s: must be above 0, got 0" in capsys.readouterr().err


def test_the_cuda_test_files_are_found_by_their_marker():
    files = gpu_check.cuda_test_files()
    assert {"tests/integration/test_cuda.py", "tests/integration/test_collective.py"} <= set(files)
    assert all("pytest.mark.cuda" in (ROOT / f).read_text() for f in files)
    assert "tests/unit/test_gpu_check.py" not in files  # names the marker only inside strings, never marks a test


@pytest.mark.parametrize("line, expected", [
    ("16 passed, 3 skipped, 80 deselected in 51.20s", dict(passed=16, skipped=3, deselected=80, seconds=51.2)),
    ("===== 1 failed, 15 passed, 2 errors in 300.01s (0:05:00) =====",
     dict(passed=15, failed=1, errors=2, seconds=300.01)),
    ("1 error in 0.50s", dict(errors=1, seconds=0.5)),
    ("24 skipped, 11 deselected, 2 warnings in 1.84s", dict(skipped=24, deselected=11, seconds=1.84)),
    ("no tests ran in 0.12s", dict(seconds=0.12)),
])
def test_pytests_last_line_is_read_as_counts(line, expected):
    counts = {k: 0 for k in gpu_check.COUNTS}
    assert gpu_check.parse_pytest_summary(["collected 99 items", "....s", line]) == {**counts, **expected}


def test_no_summary_line_reads_as_none():
    assert gpu_check.parse_pytest_summary(["collected 3 items", "..", "Timeout", ""]) is None


def _rows(**overrides) -> list[dict]:
    """A full bench at 4096 MiB: floors at 1000 and 10 GB/s, every goal row at 0.8x of its floor."""
    gbps = {"device copy": 1000.0, "d2h pageable": 10.0, "put_shard ipc": 800.0, "get_shard ipc": 800.0,
            "get_shard no-ipc": 8.0, "agent-to-agent ipc": 800.0, "put_shard no-ipc": 8.0,
            "put_shard stream": 1.0}
    rows = [{"name": n, "mib": 4096, "seconds": 4096 * gpu.MiB / (g * 1e9), "gbps": g, "runs": 5}
            for n, g in gbps.items()]
    for r in rows:
        r.update(overrides.get(r["name"], {}))
    return gpu.judged(rows, 4096)


def _passed_tests() -> "gpu_check.Step":
    return gpu_check.Step("CUDA tests", 300.0, rc=0, seconds=61.0, tail=["16 passed, 3 skipped in 60.00s"])


def test_a_clean_run_passes_and_its_table_has_every_row():
    bench = gpu_check.Step("bench", 240.0, rc=0, seconds=90.0)
    table, problems = gpu_check.summarize("gpu-check on NVIDIA H200", _passed_tests(), bench,
                                          {"rows": _rows(), "error": ""}, 4096)
    assert problems == []
    lines = table.splitlines()
    assert lines[0] == "gpu-check on NVIDIA H200" and lines[-1].startswith("gpu-check passed")
    assert "16 passed, 0 failed, 0 errors, 3 skipped" in lines[2] and "passed" in lines[2]
    put = next(line for line in lines if line.startswith("put_shard ipc"))
    assert put.split()[2:] == ["4096", "0.0054", "800.0", "0.80x", ">=0.5x", "met"]
    assert next(line for line in lines if line.startswith("device copy")).split()[-1] == "floor"


def test_every_failure_is_named_under_the_table():
    tests = gpu_check.Step("CUDA tests", 300.0, rc=1, seconds=70.0, tail=["2 failed, 14 passed in 69.00s"])
    bench = gpu_check.Step("bench", 150.0, rc=None, seconds=150.0, timed_out=True)
    rows = [r for r in _rows(**{"put_shard ipc": {"gbps": 300.0},
                                "get_shard ipc": {"error": "DataLossError: digest mismatch", "gbps": None}})
            if r["name"] != "put_shard no-ipc"]  # killed before its last goal row
    table, problems = gpu_check.summarize("h", tests, bench, {"rows": rows, "error": ""}, 4096)
    assert problems == [
        "2 CUDA tests failed and 0 errored (pytest.log)",
        "bench/gpu.py ran past its 150 s wall limit and was killed (bench.log; the rows it finished are below)",
        "bench row 'put_shard ipc' at 4096 MiB missed its goal: 0.30x of device copy, the goal >= 0.5x",
        "bench row 'get_shard ipc' at 4096 MiB failed: DataLossError: digest mismatch",
        "bench row 'put_shard no-ipc' at 4096 MiB did not run, so its goal is not shown met",
    ]
    assert "gpu-check FAILED:" in table and "MISSED" in table and "DataLossError: digest mismatch" in table


def test_tests_that_all_skip_or_time_out_fail_and_a_bench_without_json_says_so():
    skipped = gpu_check.Step("CUDA tests", 300.0, rc=0, seconds=3.0, tail=["24 skipped, 11 deselected in 1.84s"])
    killed = gpu_check.Step("CUDA tests", 300.0, rc=None, seconds=300.0, timed_out=True, tail=["....."])
    crashed = gpu_check.Step("bench", 240.0, rc=1, seconds=2.0)
    _, problems = gpu_check.summarize("h", skipped, crashed, None, 4096)
    assert problems == ["no CUDA test passed: every one was skipped or none was collected (the skip reasons are "
                        "in pytest.log)", "bench/gpu.py wrote no readable bench.json (bench.log)"]
    table, problems = gpu_check.summarize("h", killed, crashed, {"rows": [], "error": "UnavailableError: agent"},
                                          4096)
    assert problems[:2] == ["the CUDA tests ran past their 300 s wall limit and were killed (pytest.log shows where)",
                            "bench/gpu.py stopped: UnavailableError: agent"]
    assert "killed at its 300 s limit" in table


def test_goals_are_judged_at_the_large_size_only():
    rows = gpu.judged([{"name": "device copy", "mib": 256, "gbps": 100.0},
                       {"name": "put_shard ipc", "mib": 256, "gbps": 10.0}], goal_mib=4096)
    assert (rows[1]["floor"], rows[1]["ratio"], rows[1]["goal"], rows[1]["met"]) == ("device copy", 0.1, None, None)
    assert "MISSED" not in gpu.row_line(rows[1])


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_installs_into_the_named_python_without_network():
    # Run by make test, this make is a sub-make: without the parent's variables it prints no "Entering directory"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    out = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", "GPU_PYTHON=python3", "WHEELS=.whl"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    pips = [line for line in out.stdout.splitlines() if "python3 -m pip" in line and " install " in line]
    assert len(pips) == 2, out.stdout  # the wheels first (a setuptools among them builds reshard), then reshard
    for line in pips:
        assert "--no-index --no-deps --no-build-isolation" in line
    assert '"$@"' in pips[0] and "set -- .whl/*.whl" in out.stdout and pips[1].endswith("-e .")
    assert out.stdout.splitlines()[-1].strip() == "python3 bench/gpu_check.py"
    assert ".venv" not in out.stdout


def test_a_wheel_loses_the_folders_named_and_their_record_lines_and_keeps_the_rest(tmp_path):
    """`bench/_wheels.py`, which `bench/gpu_wheels.sh` runs on NIXL's wheel: 75 MB of wheels came to 45 MB without
    its expert-parallel kernels, within what the GPU host's runner carries."""
    import zipfile

    spec = importlib.util.spec_from_file_location("bench_wheels", ROOT / "bench" / "_wheels.py")
    wheels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheels)
    wheel = tmp_path / "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    record = "nixl_cu13/__init__.py,sha256=a,1\nnixl_ep_cu13/ep.so,sha256=b,9\nnixl_cu13-1.5.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("nixl_cu13/__init__.py", "x")
        z.writestr("nixl_ep_cu13/ep.so", b"\0" * 9)
        z.writestr("nixl_ep_cu13x/kept.py", "kept: another folder that only starts alike")
        z.writestr("nixl_cu13-1.5.1.dist-info/RECORD", record)
    assert wheels.drop(wheel, ["nixl_ep_cu13"]) == 1
    with zipfile.ZipFile(wheel) as z:
        assert z.testzip() is None
        assert z.namelist() == ["nixl_cu13/__init__.py", "nixl_ep_cu13x/kept.py", "nixl_cu13-1.5.1.dist-info/RECORD"]
        assert z.read("nixl_cu13-1.5.1.dist-info/RECORD").decode() == (
            "nixl_cu13/__init__.py,sha256=a,1\nnixl_cu13-1.5.1.dist-info/RECORD,,\n")
    assert not list(tmp_path.glob("*.tmp"))
