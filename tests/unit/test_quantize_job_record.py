"""A reshard_many job that quantizes on the way keeps its ``dtypes`` in the record the planner saves (``--state``),
and a record saved before the field existed reads back as a job that converts nothing; the version it commits
remembers the dtype it was quantized from."""

from __future__ import annotations

import json

from reshard import Mesh, Sharding
from reshard.server.planner.jobs import Job

SERVE = Mesh.from_hosts({"tp": 2}, ["host2", "host3"], 1)


def test_the_dtypes_a_job_quantizes_to_are_saved_and_read_back():
    dsts = {"w": Sharding(SERVE, ("tp", None)), "w_s": Sharding(SERVE, ("tp", None))}
    job = Job("j" * 32, "w", None, "auto", kind="reshard_many", inputs=["w", "w_s"], dsts=dsts,
              scales={"w": ["w_s", None]}, dtypes={"w": "float8_e4m3fn"})
    saved = json.loads(job.json_text())
    assert saved["dtypes"] == {"w": "float8_e4m3fn"}
    assert Job.from_json(saved, None).dtypes == {"w": "float8_e4m3fn"}


def test_a_record_saved_before_dtypes_reads_back_converting_nothing():
    job = Job("k" * 32, "w", None, "auto", kind="reshard_many", inputs=["w"],
              dsts={"w": Sharding(SERVE, ("tp", None))})
    saved = json.loads(job.json_text())
    del saved["dtypes"]
    back = Job.from_json(saved, None)
    assert back.dtypes == {} and back.dsts == job.dsts


def test_a_quantized_version_keeps_the_dtype_it_came_from_in_the_state_and_old_records_have_none():
    from reshard.server.planner.catalog import TensorRecord

    rec = TensorRecord("w", (256, 512), "float8_e4m3fn", Sharding(SERVE, ("tp", None)), 2, step=7, content="c",
                       converted_from="bfloat16")
    assert json.loads(rec.json_text()) == rec.to_json() and rec.to_json()["converted_from"] == "bfloat16"
    assert TensorRecord.from_json(json.loads(rec.json_text())) == rec
    plain = TensorRecord("v", (4,), "float32", Sharding(SERVE, (None,)), 1)
    assert "converted_from" not in plain.json_text() and json.loads(plain.json_text()) == plain.to_json()
    assert TensorRecord.from_json(plain.to_json()).converted_from == ""
