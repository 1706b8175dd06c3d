"""The task trace's writer (`reshard.server.agent.trace`) and reader (`reshard.server.devtools.task_trace`) on
made-up tasks: a line per task with the stored tensor's name, each host's part of a job in seconds after the job's
first task, a job named by a prefix, lines that are not records skipped and counted, and a directory that cannot be
written refused with a message naming it (``reshard agent`` exits with status 2 on it, as on any ReshardError)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reshard.errors import ReshardError
from reshard.server.agent.trace import TaskTrace, TaskTraceError
from reshard.server.devtools.task_trace import format_trace, job_trace, main, read


def _task(step: int, role: str, kind: str = "move", kernel: str = "", tensor: str = "t", peer: str = ""):
    return SimpleNamespace(step=SimpleNamespace(id=step, kind=kind, kernel=kernel, tensor=tensor, output=None),
                           role=role, depth=0, hop=0, peer=peer)


def test_each_hosts_part_of_a_job_in_seconds_after_its_first_task(tmp_path, capsys):
    a, b = TaskTrace(tmp_path, "a"), TaskTrace(tmp_path, "b")
    names = {"t": "model.w"}
    a.record("job-1", _task(0, "compute", "compute", "fp8_quantize"), names, 0, 100.0, 100.5, True)
    a.record("job-1", _task(1, "send"), names, 4096, 100.5, 101.0, True)
    b.record("job-1", _task(1, "recv", peer="a"), names, 4096, 100.2, 101.1, True)
    b.record("job-2", _task(0, "send"), names, 10, 200.0, 200.1, False)
    for t in (a, b):
        t.close()
    with (tmp_path / "b.jsonl").open("a") as f:
        f.write('{"cut short\n')
        f.write('{"job": "job-1", "host": "b", "role": "send", "start": "soon", "end": 1}\n')
    records, bad = read(tmp_path)
    assert (len(records), bad) == (4, 2)
    assert {r["tensor"] for r in records} == {"model.w"}  # the stored name, not the program's
    one = job_trace(records, "job-1")
    assert [p.host for p in one.hosts] == ["a", "b"]
    ha, hb = one.hosts
    assert (ha.tasks, ha.first_start, ha.last_end, ha.first_send, ha.sent_bytes) == (2, 0.0, 1.0, 0.5, 4096)
    assert ha.compute_s == pytest.approx(0.5) and ha.move_s == pytest.approx(0.5) and ha.last_kernel == 0.5
    assert (hb.first_send, hb.move_s, hb.failed, hb.last_kernel) == (None, pytest.approx(0.9), 0, None)
    assert one.longest[0]["role"] == "recv"  # 0.9 s, the longest
    last = job_trace(records)  # the job that ended last
    assert last.job == "job-2" and last.hosts[0].failed == 1
    with pytest.raises(ValueError, match="names 2 of the traced jobs"):
        job_trace(records, "job-")
    assert "fp8_quantize model.w" in format_trace(one)
    assert main([str(tmp_path), "--job", "job-1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("job job-1: 3 tasks on 2 hosts") and "2 lines could not be read" in out
    assert main([str(tmp_path / "none")]) == 2
    assert "no *.jsonl task traces here" in capsys.readouterr().err


def test_a_directory_that_cannot_be_written_is_refused_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(TaskTraceError, match=f"--trace-dir {blocker / 'trace'}: cannot append to") as e:
        TaskTrace(blocker / "trace", "h0")
    assert isinstance(e.value, ReshardError)


def test_a_trace_that_cannot_be_written_any_more_stops_without_failing_the_task(tmp_path, caplog):
    trace = TaskTrace(tmp_path, "h0")
    trace._file.close()  # as if the disk were gone: the next line has nowhere to go
    trace._file = open("/dev/full", "w", buffering=1)  # noqa: SIM115 - every write fails with ENOSPC
    trace.record("job-1", _task(0, "send"), {}, 1, 1.0, 2.0, True)  # no exception
    assert "tracing stops here, jobs go on" in caplog.text
    trace.record("job-1", _task(1, "send"), {}, 1, 2.0, 3.0, True)  # and none after
    assert caplog.text.count("tracing stops here") == 1
