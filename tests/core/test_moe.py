"""MoE state dicts (`reshard.moe`): a Kimi-K2-like model's names, shapes, dtypes and layouts.

The full model (61 layers, 384 experts) on the records' meshes (256 training GPUs as 32 x 8 in bfloat16, 128
serving GPUs as 16 x 8 in fp8, 8 replicas of an expert-parallel group of 16) is counted and its layouts read back
tensor by tensor; the small version (2 layers, 16 experts) is planned whole with `plan_many` and its scales. How
fast the full one is declared is `bench/plan_quality.py`'s to measure (its MoE rows), not a test's.
"""

from __future__ import annotations

import math

import pytest

from reshard import InvalidMeshError, Mesh, Sharding, Topology, plan_many
from reshard.errors import ScaleLayoutError
from reshard.many import follow_scales
from reshard.moe import KIMI_K2, SMALL_MOE, MoeConfig, MoeConfigError, moe_state_dict

TRAIN = Mesh.grid({"host": 32, "gpu": 8}, 8, "train")
SERVE = Mesh.grid({"host": 16, "gpu": 8}, 8, "serve")


@pytest.fixture(scope="module")
def kimi():
    return moe_state_dict(KIMI_K2, TRAIN, SERVE, ep_devices=16)


def test_kimi_k2_has_its_tensors_and_parameters(kimi):
    case = kimi
    # Per MoE layer: 384 x 3 expert weights, 3 shared-expert, 5 attention projections, 2 attention norms, 2 layer
    # norms and the router's weight and bias (1,166), and a scale for each of its 1,160 linear weights; the dense
    # layer has 12 tensors and 8 scales; the embeddings, the final norm and the head 3 more.
    assert len(case.tensors) == 60 * (1166 + 1160) + 12 + 8 + 3 == 139_583
    assert len(case.scales) == 69_608
    assert case.num_params == 1_026_408_232_448  # 1.03 T
    assert case.train_bytes == 2 * case.num_params + 60 * 384 * 2  # bfloat16, but the router's bias in float32
    assert 1.02e12 < case.serve_bytes < 1.04e12  # fp8 experts and attention, bfloat16 embeddings, float32 scales
    assert str(case) == ("MoeCase(61 layers, 384 experts, hidden 7168: 139,583 tensors, 1.03 T parameters; training "
                         "32 x 8 bfloat16 -> serving 16 x 8 float8_e4m3fn, 8 replicas of 16 devices)")


def test_kimi_k2s_layouts_tensor_by_tensor(kimi):
    case = kimi
    by_name = {t.name: t for t in case.tensors}
    down = by_name["model.layers.7.mlp.experts.383.down_proj.weight"]
    assert down.shape == (7168, 2048) and down.dtype == "bfloat16"
    # training: expert 383 on host 383 * 32 // 384 = 31, its columns over that host's 8 GPUs
    assert down.src == Sharding(Mesh({"gpu": 8}, [f"train31/{i}" for i in range(8)]), (None, "gpu"))
    # serving: expert-parallel rank 383 * 16 // 384 = 15, the last GPU of each replica's 2 hosts, whole
    assert down.dst == Sharding(Mesh({"replica": 8}, [f"serve{2 * k + 1}/7" for k in range(8)]), (None, None))
    up = by_name["model.layers.7.mlp.experts.12.up_proj.weight"]
    assert up.src.mesh.hosts == ("train1",) and up.src.spec_str() == "P('gpu', None)"
    assert up.dst.mesh.devices == tuple(f"serve{2 * k}/0" for k in range(8))
    scale = by_name["model.layers.7.mlp.experts.383.down_proj.weight_scale_inv"]
    assert scale.shape == (56, 16) and scale.dtype == "float32" and case.serve_dtypes[down.name] == "float8_e4m3fn"
    assert scale.src == Sharding(down.src.mesh, (None, "gpu")) and scale.dst == down.dst
    rows = Sharding(TRAIN, (("host", "gpu"), None))
    for name, dst_spec in (("self_attn.q_b_proj", ("gpu", None)), ("self_attn.o_proj", (None, "gpu")),
                           ("self_attn.kv_a_proj_with_mqa", (None, None)),
                           ("mlp.shared_experts.gate_proj", ("gpu", None)),
                           ("mlp.shared_experts.down_proj", (None, "gpu")), ("mlp.gate", (None, None))):
        t = by_name[f"model.layers.7.{name}.weight"]
        assert (t.src, t.dst) == (rows, Sharding(SERVE, dst_spec)), name
    assert by_name["model.layers.0.mlp.down_proj.weight"].shape == (7168, 18432)  # the dense layer
    assert by_name["lm_head.weight"].dst == Sharding(SERVE, ("gpu", None))
    assert by_name["model.norm.weight"].dst == Sharding(SERVE, (None,))
    bias = by_name["model.layers.7.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == case.serve_dtypes[bias.name] == "float32"
    assert "model.layers.7.mlp.gate.weight" not in case.scales  # the router stays in bfloat16
    # every scale's serving layout is its weight's, block for block, as plan_many would derive it
    assert follow_scales(case.tensors, case.scales) == list(case.tensors)
    # each serving GPU holds 24 experts a layer; each training host 12
    ranks = {}
    for t in case.tensors:
        if ".experts." in t.name and t.name.endswith("gate_proj.weight") and ".layers.7." in t.name:
            ranks.setdefault(t.dst.mesh.devices[0], []).append(t.src.mesh.hosts[0])
    assert len(ranks) == 16 and {len(v) for v in ranks.values()} == {24}
    assert {len(set(v)) for v in ranks.values()} == {2}  # 24 consecutive experts: 12 from each of two hosts


def test_served_unquantized_there_are_no_scales():
    case = moe_state_dict(MoeConfig(serve_dtype="bfloat16", num_layers=3), TRAIN, SERVE)
    assert not case.scales and len(case.tensors) == 2 * 1166 + 12 + 3
    assert set(case.serve_dtypes.values()) == {"bfloat16", "float32"}


def test_the_small_model_plans_whole_with_its_scales_on_gpu_hosts():
    train, serve = Mesh.grid({"host": 4, "gpu": 2}, 2, "t"), Mesh.grid({"host": 2, "gpu": 2}, 2, "s")
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=2)
    assert len(case.tensors) == (1166 - 384 * 3 + 16 * 3) + (1160 - 384 * 3 + 16 * 3) + 12 + 8 + 3 == 141
    attention = 256 * 256 + 2048 * 256 + 192 * 256 + 2048 * 128 + 256 * 1024 + 256 * 3 + 128  # with its norms
    mlp = 3 * 1024 * 256
    assert case.num_replicas == 2
    assert case.num_params == 2 * 1024 * 256 + 256 + 2 * attention + mlp + (16 * 256 + 16) + mlp + 16 * mlp
    topology = Topology.gpu_hosts(nics=2)
    program = plan_many(case.tensors, topology, scales=case.scales).validate()
    assert {d.name for d in program.tensors} == {t.name for t in case.tensors}
    assert 0 < program.estimate_seconds < math.inf
    # two rails of 400 Gbit/s price as one NIC of 800 would: the host's rails added up
    one_nic = Topology(nic_gbps=800.0, intra_host_gbps=3600.0, memory_gb_per_s=3350.0, device_gflops=67_000.0)
    assert program.estimate(one_nic) == pytest.approx(program.estimate_seconds, rel=1e-12)
    assert program.estimate(Topology(nic_gbps=400.0, intra_host_gbps=3600.0)) > 1.5 * program.estimate_seconds


def test_meshes_and_groups_that_name_no_layout_are_refused():
    with pytest.raises(MoeConfigError, match=r"^ep_devices 24 does not divide the serving mesh's 128 devices into "
                                             r"replicas; give a divisor of 128, such as 16$"):
        moe_state_dict(SMALL_MOE, TRAIN, SERVE, ep_devices=24)
    wide = Mesh.grid({"host": 2, "gpu": 16}, 16, "w")  # a cut of 1024 rows into 16 is 64: half a block
    with pytest.raises(ScaleLayoutError, match=r"^scale 'model.layers.0.self_attn.o_proj.weight_scale_inv' .* starts "
                                               r"at 64 along dim 1, inside a block of 128 elements"):
        moe_state_dict(SMALL_MOE, TRAIN, wide, ep_devices=16)
    with pytest.raises(InvalidMeshError, match=r"^the training mesh .* has 3 axes; give it two, hosts x devices"):
        moe_state_dict(SMALL_MOE, Mesh.grid({"a": 2, "b": 2, "c": 2}, 4, "x"), SERVE)
    across = Mesh({"host": 2, "gpu": 2}, ["a/0", "b/0", "a/1", "b/1"])
    with pytest.raises(InvalidMeshError, match=r"^row 0 of the serving mesh .* lies on hosts \['a', 'b'\]"):
        moe_state_dict(SMALL_MOE, TRAIN, across, ep_devices=2)
    with pytest.raises(MoeConfigError, match=r"^MoeConfig.num_experts is 0; it counts or sizes something"):
        MoeConfig(num_experts=0)
    with pytest.raises(MoeConfigError, match=r"^serve_dtype 'float16': a model is served in its training dtype"):
        MoeConfig(serve_dtype="float16")
