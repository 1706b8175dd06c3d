"""Mixture-of-experts state dicts as cases: a Kimi-K2-like model's tensors, in its training and its serving layout.

`moe_state_dict` names every tensor of a DeepSeek-V3-architecture model (Kimi K2's: multi-head latent attention,
a first dense layer, then routed and shared experts) as the Hugging Face checkpoint names it, with its shape,
dtype and both layouts, as `TensorDecl` records that `reshard.plan_many` takes. Serving in fp8 adds a float32
``weight_scale_inv`` beside each quantized weight: one entry per 128 x 128 block, what the weight's fp8 values
are multiplied by (the format the ``fp8_quantize`` and ``fp8_scales`` kernels make).

Training is a (hosts x devices) mesh; serving one too, cut into replicas of ``ep_devices`` consecutive devices
(an expert-parallel group). Expert ``e`` of ``experts`` lives on training host ``e * hosts // experts`` and on
expert-parallel rank ``e * ep_devices // experts`` of every replica.

================= ================================================ ==============================================
tensor            training                                         serving
================= ================================================ ==============================================
routed expert     its host's devices split it: gate and up by      whole on its rank's device of every replica
                  rows, down by columns
column-parallel   rows over every device                           rows over each host's devices, on every host
(q_b, kv_b, gate,
up, embeddings,
head)
row-parallel      rows over every device                           columns over each host's devices, on every
(o, down)                                                          host
replicated (q_a,  rows over every device                           whole on every device
kv_a, norms,
router)
scale             the weight's mesh and axes per dim               its weight's tiles, block for block
                                                                   (`reshard.many.scale_sharding`)
================= ================================================ ==============================================

Only linear layers are quantized (attention projections and every MLP's); embeddings, the output head, norms
and the router stay in the training dtype, and the router's score bias in float32, as in the released fp8
checkpoints. A scale's training layout is its weight's axes; the scales are made on the way
(``plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes)``, `reshard.quantize`), so that layout is
never read: where a weight's training tiles start on block boundaries (every expert's) each sender quantizes its
own tile; where they cut blocks (rows over every training device) the planner first gathers whole blocks into a
block-aligned layout over the same devices (rows over hosts and columns over a host's devices, where a host's rows
are whole blocks: the gather then stays within hosts) and quantizes there.
Meshes are named devices on named hosts (``Mesh.grid``); no machine need exist, as for any plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

from reshard.dtypes import dtype_name, itemsize
from reshard.errors import InvalidMeshError, ReshardError
from reshard.many import scale_sharding
from reshard.mesh import Mesh, host_of
from reshard.program import TensorDecl
from reshard.sharding import Sharding

__all__ = ["MoeConfig", "MoeCase", "MoeConfigError", "moe_state_dict", "KIMI_K2", "SMALL_MOE", "SCALE_SUFFIX"]

SCALE_SUFFIX = "_scale_inv"  # "w.weight" -> "w.weight_scale_inv", as the fp8 checkpoints name a weight's scales
_FP8 = "float8_e4m3fn"

# A tensor's part in the layouts of the module docstring's table.
_EXPERT_ROWS, _EXPERT_COLS, _COL, _ROW, _REPLICATED = "expert rows", "expert columns", "column", "row", "replicated"


class MoeConfigError(ReshardError, ValueError):
    """A model configuration or layout parameter that names no valid MoE state dict; the message says which."""


@dataclass(frozen=True)
class MoeConfig:
    """The shapes and dtypes of a DeepSeek-V3-architecture MoE model; the defaults are Kimi K2's."""

    num_layers: int = 61
    num_dense_layers: int = 1  # the first layers have a dense MLP instead of experts
    num_experts: int = 384  # routed experts per MoE layer
    num_shared_experts: int = 1
    hidden: int = 7168
    intermediate: int = 2048  # of one expert (and of each shared expert)
    dense_intermediate: int = 18432
    vocab: int = 163840
    num_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    train_dtype: str = "bfloat16"
    serve_dtype: str = _FP8  # or the training dtype: served unquantized, no scales
    block: int = 128  # of the fp8 scales: block x block elements share one

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                if not (f.name in ("num_dense_layers", "num_shared_experts") and value == 0):
                    raise MoeConfigError(f"MoeConfig.{f.name} is {value!r}; it counts or sizes something, so it is a "
                                         f"positive integer")
        if self.num_dense_layers > self.num_layers:
            raise MoeConfigError(f"MoeConfig has {self.num_dense_layers} dense layers of {self.num_layers}; the dense "
                                 f"layers are the first layers, at most all of them")
        object.__setattr__(self, "train_dtype", dtype_name(self.train_dtype))
        object.__setattr__(self, "serve_dtype", dtype_name(self.serve_dtype))
        if self.serve_dtype not in (self.train_dtype, _FP8):
            raise MoeConfigError(f"serve_dtype {self.serve_dtype!r}: a model is served in its training dtype "
                                 f"({self.train_dtype!r}) or quantized to {_FP8!r} with block scales")

    @property
    def quantized(self) -> bool:
        return self.serve_dtype == _FP8

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...], str, int, bool]]:
        """Every weight of the checkpoint as (name, shape, part, routed expert or -1, whether fp8 quantizes it);
        parts as the module docstring's table names them."""
        h, heads = self.hidden, self.num_heads
        yield "model.embed_tokens.weight", (self.vocab, h), _COL, -1, False
        attention = (
            ("q_a_proj", (self.q_lora_rank, h), _REPLICATED),
            ("q_b_proj", (heads * (self.qk_nope_head_dim + self.qk_rope_head_dim), self.q_lora_rank), _COL),
            ("kv_a_proj_with_mqa", (self.kv_lora_rank + self.qk_rope_head_dim, h), _REPLICATED),
            ("kv_b_proj", (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank), _COL),
            ("o_proj", (h, heads * self.v_head_dim), _ROW),
        )
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            yield f"{p}.input_layernorm.weight", (h,), _REPLICATED, -1, False
            yield f"{p}.post_attention_layernorm.weight", (h,), _REPLICATED, -1, False
            for name, shape, part in attention:
                yield f"{p}.self_attn.{name}.weight", shape, part, -1, True
            yield f"{p}.self_attn.q_a_layernorm.weight", (self.q_lora_rank,), _REPLICATED, -1, False
            yield f"{p}.self_attn.kv_a_layernorm.weight", (self.kv_lora_rank,), _REPLICATED, -1, False
            if i < self.num_dense_layers:
                yield from _mlp(f"{p}.mlp", h, self.dense_intermediate, _COL, _ROW, -1)
                continue
            yield f"{p}.mlp.gate.weight", (self.num_experts, h), _REPLICATED, -1, False
            yield f"{p}.mlp.gate.e_score_correction_bias", (self.num_experts,), _REPLICATED, -1, False
            if self.num_shared_experts:
                yield from _mlp(f"{p}.mlp.shared_experts", h, self.num_shared_experts * self.intermediate, _COL, _ROW,
                                -1)
            for e in range(self.num_experts):
                yield from _mlp(f"{p}.mlp.experts.{e}", h, self.intermediate, _EXPERT_ROWS, _EXPERT_COLS, e)
        yield "model.norm.weight", (h,), _REPLICATED, -1, False
        yield "lm_head.weight", (self.vocab, h), _COL, -1, False


def _mlp(prefix: str, hidden: int, inner: int, up_part: str, down_part: str, expert: int):
    yield f"{prefix}.gate_proj.weight", (inner, hidden), up_part, expert, True
    yield f"{prefix}.up_proj.weight", (inner, hidden), up_part, expert, True
    yield f"{prefix}.down_proj.weight", (hidden, inner), down_part, expert, True


KIMI_K2 = MoeConfig()
# 2 layers (one dense, one of 16 experts) whose every tensor-parallel cut falls on a block boundary on up to 8
# devices a host, so that its scales follow their weights on the meshes of the tests and the emulated lab.
SMALL_MOE = MoeConfig(num_layers=2, num_experts=16, hidden=256, intermediate=1024, dense_intermediate=1024,
                      vocab=1024, num_heads=16, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
                      qk_rope_head_dim=64, v_head_dim=64)


@dataclass(frozen=True, eq=False)
class MoeCase:
    """A model's state dict moved from its training layout to its serving layout: ``tensors`` (each weight, then
    its scale where it is quantized) with ``src`` and ``dst``, in the training dtype; ``serve_dtypes`` the dtype
    each is held in when served; ``scales`` each quantized weight's scale, as `reshard.plan_many` takes them."""

    config: MoeConfig
    train: Mesh
    serve: Mesh
    ep_devices: int
    tensors: tuple[TensorDecl, ...]
    serve_dtypes: Mapping[str, str]
    scales: Mapping[str, str]

    @property
    def weights(self) -> tuple[TensorDecl, ...]:
        """The tensors less the scales: the training state dict."""
        scales = set(self.scales.values())
        return tuple(t for t in self.tensors if t.name not in scales)

    @property
    def num_params(self) -> int:
        """Elements of the weights (scales not counted)."""
        return sum(math.prod(t.shape) for t in self.weights)

    @property
    def train_bytes(self) -> int:
        """Bytes of the training state dict (the weights in their training dtypes)."""
        return sum(math.prod(t.shape) * t.itemsize for t in self.weights)

    @property
    def serve_bytes(self) -> int:
        """Bytes of one serving replica's state dict: the weights as served, and their scales."""
        return sum(math.prod(t.shape) * itemsize(self.serve_dtypes[t.name]) for t in self.tensors)

    @property
    def num_replicas(self) -> int:
        return self.serve.size // self.ep_devices

    def __str__(self) -> str:
        c = self.config
        return (f"MoeCase({c.num_layers} layers, {c.num_experts} experts, hidden {c.hidden}: {len(self.tensors):,} "
                f"tensors, {_count(self.num_params)} parameters; training {_grid(self.train)} {c.train_dtype} "
                f"-> serving {_grid(self.serve)} {c.serve_dtype}, {self.num_replicas} replicas of "
                f"{self.ep_devices} devices)")


def _count(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:,}"


def _grid(mesh: Mesh) -> str:
    return " x ".join(str(n) for n in mesh.shape)


def _rows_are_hosts(mesh: Mesh, what: str) -> tuple[str, str, int, int]:
    """The host axis, the device axis and their sizes of a (hosts x devices) mesh whose every row is one host."""
    if len(mesh.axes) != 2:
        raise InvalidMeshError(f"the {what} mesh {mesh} has {len(mesh.axes)} axes; give it two, hosts x devices a "
                               f"host, e.g. Mesh.grid({{'host': 32, 'gpu': 8}}, 8, 'train')")
    devices = mesh.require_devices()
    (host_axis, hosts), (device_axis, per_host) = mesh.axes
    for row in range(hosts):
        names = {host_of(d) for d in devices[row * per_host:(row + 1) * per_host]}
        if len(names) != 1:
            raise InvalidMeshError(f"row {row} of the {what} mesh {mesh} lies on hosts {sorted(names)}; each row of "
                                   f"a (hosts x devices) mesh is one host's devices, as Mesh.grid lays them out")
    return host_axis, device_axis, hosts, per_host


def moe_state_dict(config: MoeConfig, train: Mesh, serve: Mesh, ep_devices: int = 16) -> MoeCase:
    """``config``'s state dict from ``train`` to ``serve`` (each a hosts x devices mesh), laid out as the module
    docstring's table says, ``serve`` cut into replicas of ``ep_devices`` devices each.

    Raises `MoeConfigError` for an expert-parallel group that does not divide the serving mesh, and
    `reshard.errors.ScaleLayoutError` where a serving cut does not fall on a block boundary (its scales could not
    follow the weight).
    """
    t_host, t_dev, t_hosts, t_per_host = _rows_are_hosts(train, "training")
    s_host, s_dev, _, _ = _rows_are_hosts(serve, "serving")
    if isinstance(ep_devices, bool) or not isinstance(ep_devices, int) or ep_devices < 1 or serve.size % ep_devices:
        raise MoeConfigError(f"ep_devices {ep_devices!r} does not divide the serving mesh's {serve.size} devices into "
                             f"replicas; give a divisor of {serve.size}, such as {math.gcd(serve.size, 16)}")
    replicas = serve.size // ep_devices
    train_devices, serve_devices = train.require_devices(), serve.require_devices()
    c = config

    # A few distinct layouts serve every tensor: each made once, the scales' too (`scale_sharding` checks its
    # weight's tiles, which 139,000 calls would repeat).
    train_host_mesh = [Mesh({t_dev: t_per_host}, train_devices[h * t_per_host:(h + 1) * t_per_host])
                       for h in range(t_hosts)]
    expert_src = {part: [Sharding(m, (t_dev, None) if part == _EXPERT_ROWS else (None, t_dev)) for m in train_host_mesh]
                  for part in (_EXPERT_ROWS, _EXPERT_COLS)}
    rank_mesh = [Mesh({"replica": replicas}, serve_devices[r::ep_devices]) for r in range(ep_devices)]
    expert_dst = [Sharding(m, (None, None)) for m in rank_mesh]
    all_rows = {1: Sharding(train, ((t_host, t_dev),)), 2: Sharding(train, ((t_host, t_dev), None))}
    serving = {(_COL, 2): Sharding(serve, (s_dev, None)), (_ROW, 2): Sharding(serve, (None, s_dev)),
               (_REPLICATED, 1): Sharding(serve, (None,)), (_REPLICATED, 2): Sharding(serve, (None, None))}
    scale_layouts: dict[tuple, tuple[Sharding, Sharding]] = {}

    tensors: list[TensorDecl] = []
    serve_dtypes: dict[str, str] = {}
    scales: dict[str, str] = {}
    block = c.block
    for name, shape, part, expert, quantize in c.tensors():
        if expert >= 0:
            src = expert_src[part][expert * t_hosts // c.num_experts]
            dst = expert_dst[expert * ep_devices // c.num_experts]
        else:
            src, dst = all_rows[len(shape)], serving[part, len(shape)]
        dtype = "float32" if name.endswith("e_score_correction_bias") else c.train_dtype
        tensors.append(TensorDecl(name, shape, dtype, src, dst))
        if not (quantize and c.quantized):
            serve_dtypes[name] = dtype
            continue
        serve_dtypes[name] = _FP8
        scale_shape = (-(-shape[0] // block), -(-shape[1] // block))
        key = (shape, src, dst)
        layouts = scale_layouts.get(key)
        if layouts is None:
            layouts = scale_layouts[key] = (Sharding(src.mesh, src.spec),
                                            scale_sharding(shape, dst, scale_shape, name, name + SCALE_SUFFIX, block))
        scale = name + SCALE_SUFFIX
        tensors.append(TensorDecl(scale, scale_shape, "float32", *layouts))
        serve_dtypes[scale] = "float32"
        scales[name] = scale
    return MoeCase(c, train, serve, ep_devices, tuple(tensors), MappingProxyType(serve_dtypes),
                   MappingProxyType(scales))
