"""A job's commit records are made on a thread of their own once its hosts run (`_Commits.make_meanwhile`): made
once, whoever asks first, and a failure to make them is raised where the commit asks for them. A reshard_many's
delta report, where it can wait for the run, is written the same way (`_Meanwhile`)."""

from __future__ import annotations

import threading

import pytest

from reshard.server.planner.jobs import _Commits, _Meanwhile


def test_records_made_meanwhile_are_made_once_and_are_the_ones_the_commit_reads():
    made, release = [], threading.Event()

    def make():
        release.wait(5)
        made.append(threading.current_thread().name)
        return [(None, "record")]

    commits = _Commits(make, [])
    commits.make_meanwhile()
    release.set()
    commits.check()  # waits for the thread's making where it is under way, or makes them
    assert commits.records == [(None, "record")] and len(made) == 1


def test_a_failure_to_make_the_records_is_raised_where_the_commit_asks_for_them():
    def make():
        raise RuntimeError("tensor 'w' changed")

    commits = _Commits(make, [])
    commits.make_meanwhile()
    with pytest.raises(RuntimeError, match="tensor 'w' changed"):
        commits.check()


def test_a_report_written_meanwhile_runs_once_on_its_thread_or_at_the_finish_and_raises_there():
    ran = []
    report = _Meanwhile(lambda: ran.append(threading.current_thread().name))
    report.start()
    report.finish()  # waits for the thread
    report.start()  # a host that reports its start late: nothing more
    report.finish()
    assert ran == ["job-report"]
    report = _Meanwhile(lambda: ran.append("at the finish"))
    report.finish()  # the job failed before every host ran: written here
    report.start()
    assert ran == ["job-report", "at the finish"]

    def fails():
        raise RuntimeError("record of 'w' is gone")

    report = _Meanwhile(fails)
    report.start()
    with pytest.raises(RuntimeError, match="record of 'w' is gone"):
        report.finish()
