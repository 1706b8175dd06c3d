"""One configuration object per component: every address, size and timeout lives here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from reshard.proto.auth import TlsFiles
from reshard.server.common.contract import check_host_name

__all__ = ["AgentConfig", "PlannerConfig", "MiB"]

MiB = 2**20
NIXL_LEAST_CHUNK = 1 << 20  # the smallest nixl chunk the NIC rule picks (`AgentConfig.nixl_chunk`)


@dataclass(frozen=True)
class AgentConfig:
    """An agent: one host's shard holder and mover."""

    host: str
    num_devices: int
    planner: str
    listen: str = "127.0.0.1:0"
    advertise: Optional[str] = None  # address peers dial; defaults to the bound listen address
    chunk_bytes: int = 2 * MiB  # a chain hop forwards a chunk once it has all of it: smaller fills the pipe sooner
    max_message_bytes: int = 64 * MiB  # largest chunk a peer or client may send us
    max_workers: int = 16  # gRPC server threads; concurrent transfers use the same bound
    nic_gbps: float = 10.0  # reported to the planner's cost model
    # One device's float32 GFLOP/s and memory GB/s, reported to the cost model; 0: measured at start
    # (reshard.server.agent.probe, a fraction of a second).
    device_gflops: float = 0.0
    memory_gb_per_s: float = 0.0
    # Emulate devices of this many float32 GFLOP/s (reshard.server.agent.pace), as the lab's link shaping emulates
    # a NIC: every compute step lasts at least its FLOPs at this rate, one step at a time per device, and the rate
    # is what the agent reports. For emulated hosts sharing a machine; 0: kernels at this machine's speed.
    emulate_gflops: float = 0.0
    # Threads a kernel's BLAS/OpenMP and torch pools may use (reshard.server.agent.threads), and the computes an
    # active transport runs at once (`Runtime._submit_local`); 0: the libraries' default, every core. Agents
    # sharing a machine should split its cores: local clusters and the lab do.
    compute_threads: int = 0
    heartbeat_interval_s: float = 1.0
    register_timeout_s: float = 30.0
    transfer_timeout_s: float = 300.0
    forward_queue_chunks: int = 4  # chunks a chain hop buffers before it pushes back
    rate_limit_bytes_per_s: float = 0.0  # 0: unlimited; tests slow transfers down to interrupt them
    # The collective transport (reshard.server.transport.collective): grpc, collective, or auto (collective when
    # torch is installed and the process group is up, gRPC otherwise); nixl: the NIXL transport
    # (reshard.server.transport.nixl, pip install 'reshard[nixl]'), for jobs whose hosts all run it.
    transport: str = "auto"
    # The NIXL transport's backend plugin (UCX: shared memory, TCP, RDMA, as UCX finds them), and whether UCX may
    # use TCP only (UCX_TLS=tcp): for hosts that share a kernel but not a network, as the emulated lab's do, whose
    # bytes must cross the shaped links. UCX is bound to the interface of the listen address either way
    # (reshard.server.agent.ucx); UCX_* variables set in the agent's environment are kept.
    nixl_backend: str = "UCX"
    nixl_tcp_only: bool = False
    # Where the agent's shards live, and so its collective backend: cpu (numpy arrays, gloo) or cuda[:N]
    # (torch tensors on that GPU, NCCL; one agent per GPU). Checked at start-up.
    device: str = "cpu"
    group_join_timeout_s: float = 10.0  # forming one generation of the process group
    # The plan-id confirmation before a phase, and a native all-reduce's calls. A stream's sends and receives wait
    # up to transfer_timeout_s: one may wait that long for its peer's lane to reach the stream (see
    # reshard.server.transport.collective's waits)
    collective_timeout_s: float = 30.0
    # Routes of one depth a host streams at once over the group (`Runtime._in_order`), and as many again for
    # routes under 1 MiB. A lane holds its unit until every host of the route reaches it, so with few lanes a host
    # whose next unit waits for a busy peer leaves its links idle: bench/moe_sync.py's kimi-k2 sync (routes through
    # 4 serving hosts in many orders) took 11.6 s on emulated 1 Gbit/s links with 4, 11.2 with 8, 10.3-10.8 with
    # 16, 10.1-10.4 with 32 (nixl: 15.7 with 4, 14.7 with 16), while bench/weight_sync.py's, on those links and on
    # loopback, and the hidden-512 MoE sync on loopback moved within noise of themselves from 4 to 16. On a quieter
    # machine, one cluster per setting taking turns (2026-12-02 and -03): kimi-k2 medians of 3 with 16 lanes 9.76,
    # 9.74, 9.64, 9.71 s, with 32 9.62, 9.48, 9.31, 9.46 s (every pair faster with 32); bench/weight_sync.py with
    # 16, then 32, twice: reshard_many at 1.04x, 0.88x raw gloo's speed with 16 and 1.00x, 1.08x with 32, the
    # emulated sync 1.18x, 1.17x its bound against 1.21x, 1.14x, its RL delta steps 1.76x, 2.25x faster than whole
    # against 1.94x, 1.94x: no loss. A lane costs a thread, and a bucket it may hold (counted up front).
    collective_lanes: int = 32
    # A directory where the agent appends a line of JSON per task it runs (reshard.server.agent.trace: when each
    # send, receive and kernel began and ended), to see where a job's time went on each host
    # (reshard.server.devtools.task_trace); "": off
    trace_dir: str = ""
    # Chunk size of the collective transport; 0: from the link rate (`collective_chunk`). A gloo or
    # NCCL message costs far less per byte than a gRPC one, so fewer, larger chunks save CPU, while a
    # chunk's time on the link is what a chain's pipeline takes to fill per hop.
    collective_chunk_bytes: int = 0
    # A replicated reduce whose members each have a host of their own runs as gloo's own all-reduce when no other
    # reduce holds those hosts' group (reshard.server.transport.collective); False: always the ring of streams,
    # each XXH3-checked. Every agent of a cluster should agree: a reduce follows whichever member decides first.
    native_reduce: bool = True
    # Fault injection for tests of end-to-end verification: "corrupt-relay" makes a chain hop flip a
    # bit of the first chunk it receives before forwarding it (and keeping it); "delta-base-differs" makes
    # every delta base this agent applies to read one bit off (the planner's fallback to full moves).
    # Never set in service.
    fault: str = ""
    # Tests only: the GPU uuid this agent reports at registration instead of its device's, so that the
    # planner's refusal of two agents on one GPU can be tested on machines without GPUs. Never set in service.
    report_gpu_uuid: str = ""
    # Security (docs/security.md): the cluster token every call carries, and TLS files for every gRPC port.
    # No token: the agent answers loopback callers only.
    token: Optional[str] = field(default=None, repr=False)
    tls: Optional[TlsFiles] = None
    # The most shard bytes (committed and staged, with programs' working and bucket buffers) the agent holds;
    # 0: 3/4 of the machine's memory, or of the GPU's for a cuda agent. What would go over it is refused before
    # it is allocated (see reshard.server.agent.memory).
    memory_limit_bytes: int = 0
    # A gRPC push whose peer takes none of its pieces this long (a paused, hung or cut-off agent) is cancelled
    # and fails its job, naming the peer; a collective stream's calls give up after transfer_timeout_s (a receive
    # may wait that long for its sender to reach it), or once their job ended on their host and the group was
    # re-formed. Either way the agent is free again, and the planner has usually failed the job sooner
    # (PlannerConfig.stall_timeout_s). Keep it well above one chunk's time on the link (chunk_bytes /
    # rate_limit_bytes_per_s included). A push that comes before its job's prepare (a small job's hosts prepare
    # inside their Execute) waits this long for it, too.
    stall_timeout_s: float = 10.0
    # On a GPU agent, a move over gRPC to a peer agent on the same machine that can map this agent's GPU goes as a
    # CUDA IPC handle of the box's region, copied device to device by the peer (reshard.server.transport.grpc_link).
    cuda_ipc: bool = True

    @property
    def collective_chunk(self) -> int:
        """The collective transport's chunk size: as set, else about 3 ms on the NIC, in whole MiB powers
        of two from 2 to 16 (4 MiB at the default 10 Gbit/s, 2 MiB at 1 Gbit/s, 16 MiB from 40 Gbit/s)."""
        return self.collective_chunk_bytes or self._chunk_on_the_nic(2 * MiB)

    @property
    def nixl_chunk(self) -> int:
        """The nixl transport's chunk size: as set (--collective-chunk-mib), else about 3 ms on the NIC in powers
        of two from 1 MiB (1 MiB at 1 and 2 Gbit/s, 4 MiB at 10, as collective from there). A chain hop learns that
        a chunk landed only once the WRITEs after it in the window are on their way too (a WRITE's notification
        leaves as it completes), so each hop of a chain adds about a window of chunks to the job, and smaller chunks
        fill a chain sooner; but every chunk costs both ends a pass through the interpreter and a wake-up or two
        (about 1 ms of CPU for a 256 KiB chunk between two agents of one process, bench/nixl_path.py, where
        NIXL alone takes a quarter of that), and where agents share cores that cost is the job's. On the emulated
        hosts' 1 Gbit/s links (bench/paper.py's cases, `auto`, medians of 5), with the machine's 2 cores to spare,
        1 MiB, 512 KiB and 256 KiB chunks took the 4-hop chain of 1to4x2 1.15, 1.13 and 1.12 s and case7 1.17, 1.13
        and 1.11 s (estimate 1.07 s); with the same cores busier, in one run of each size (256 KiB, 512 KiB, 1 MiB,
        2 MiB): 1to4x2 1.38x, 1.20x, 1.10x, 1.16x its estimate, allgather4 1.49x, 1.26x, 1.14x, 1.19x, shift1 1.71x,
        1.31x, 1.12x, 1.14x, case7 1.09x, 1.07x, 1.10x, 1.16x. A little of a chain's fill traded for not losing a
        third of the links' time where cores are short: 1 MiB. Nor do larger chunks pay where no hop forwards: 4 MiB
        for such streams took the emulated weight sync 0.983 s against 0.965 s in 1 MiB (rounds alternating, medians
        of 8)."""
        return self.collective_chunk_bytes or self._chunk_on_the_nic(NIXL_LEAST_CHUNK)

    def _chunk_on_the_nic(self, least: int) -> int:
        """About 3 ms on the NIC, in powers of two from ``least`` to 16 MiB."""
        target = self.nic_gbps * 1e9 / 8 * 0.003
        chunk = least
        while chunk < 16 * MiB and chunk * 1.5 < target:
            chunk *= 2
        return chunk

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"

    def __post_init__(self):
        if self.transport not in ("grpc", "collective", "auto", "nixl"):
            raise ValueError(f"transport {self.transport!r} is not one of grpc, collective, auto, nixl")
        if not (self.nixl_backend.isidentifier() and len(self.nixl_backend) <= 64):
            raise ValueError(f"nixl_backend {self.nixl_backend[:80]!r} is not a NIXL backend plugin's name, such as "
                             f"UCX")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device {self.device!r} is neither cpu nor cuda[:N]")
        if self.num_devices <= 0:
            raise ValueError(f"an agent needs at least one device; got num_devices={self.num_devices}")
        check_host_name(self.host)
        if self.compute_threads < 0:
            raise ValueError(f"compute_threads must be 0 (every core) or more; got {self.compute_threads}")
        if not self.emulate_gflops >= 0:
            raise ValueError(f"emulate_gflops must be 0 (off) or a positive rate; got {self.emulate_gflops}")
        if self.chunk_bytes <= 0 or self.collective_chunk_bytes < 0:
            raise ValueError(f"chunk_bytes must be positive and collective_chunk_bytes positive or 0 (sized from "
                             f"nic_gbps); got {self.chunk_bytes} and {self.collective_chunk_bytes}")
        if self.fault not in ("", "corrupt-relay", "delta-base-differs"):
            raise ValueError(f"fault {self.fault!r} is not one of '', 'corrupt-relay', 'delta-base-differs'")


@dataclass(frozen=True)
class PlannerConfig:
    """The planner service: registry, catalog and jobs."""

    listen: str = "127.0.0.1:0"
    state_path: Optional[str] = None  # SQLite file for the catalog, jobs and plans; None: memory only
    max_workers: int = 32
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0  # an agent silent this long is down
    upload_timeout_s: float = 120.0  # an upload idle this long is aborted
    # A pin (a reader's hold on older versions) unused this long expires and frees what it held: a reader that
    # died lets go; every read through a pin renews it.
    pin_timeout_s: float = 600.0
    # Delta sync (issue 40): hold each tensor's delta base pair (the versions of its last reshard_many: one extra
    # version per layout per tensor on the agents) and move tensors as their changes where that pays; False
    # (--no-delta): hold none, move every tensor whole.
    delta: bool = True
    job_timeout_s: float = 600.0  # a reshard job still moving data after this long fails
    agent_rpc_timeout_s: float = 30.0  # control calls to agents (prepare, commit, release)
    max_wait_s: float = 10.0  # longest a GetJob call blocks
    max_concurrent_jobs: int = 8
    # Host the agents' torch.distributed store (when torch is installed); without it every agent runs gRPC, and
    # the planner does not import torch (a second and a half of its start).
    rendezvous: bool = True
    group_wait_s: float = 30.0  # a job on --transport collective hosts waits this long for the group
    # Security (docs/security.md): the cluster token every call carries, and TLS files for every gRPC port.
    # No token: the planner answers loopback callers only.
    token: Optional[str] = field(default=None, repr=False)
    tls: Optional[TlsFiles] = None
    # A running job fails as soon as one of its hosts stopped answering, naming the host, on either
    # transport: when its agent is marked down (heartbeat_timeout_s without a heartbeat: a paused, hung or
    # unreachable process), or when it sent no progress report for its part of the job for stall_timeout_s
    # while its heartbeats go on. The bound: a job fails at most max(heartbeat_timeout_s, stall_timeout_s)
    # + 0.2 s (jobs.WATCH_INTERVAL_S) after its host stopped answering: 8.2 s by default, about 5 s for a
    # paused agent. The other hosts are aborted and the source stays as it was.
    stall_timeout_s: float = 8.0
    # Hostile or careless input: the largest JSON field (sharding, plan) in bytes and nesting depth, and the
    # largest plan one request may make, in unit tasks (boxes a source tile meets a destination tile in), summed
    # over a reshard_many's distinct layouts. A million: the million-piece all-to-all of bench/plan_quality.py plans
    # in 0.4 s, and the 61-layer Kimi-K2-like state dict's layouts (361,600 deliveries, 44.6 million route steps)
    # plan in about 1.5 s, which 250,000 refused.
    max_json_bytes: int = 4 * MiB
    max_json_depth: int = 32
    # The largest request a client may send and reply the planner sends: a state dict's put_many and reshard_many
    # name every tensor (a put_many of 32,000 small ones: 4.6 MB), past gRPC's default of 4 MiB
    max_message_bytes: int = 64 * MiB
    max_plan_tasks: int = 1_000_000
    # The most steps one program may hold (reshard_many's, `reshard.plan_many`): about a kilobyte of planner memory
    # each. The 61-layer Kimi-K2-like state dict is 1.6 million, 3.4 million quantized on the way.
    max_program_steps: int = 4_000_000
    # A program whose text is this long or longer is cut per host (`reshard.host_slice`): each agent is handed the
    # steps it takes part in, not every host's (the Kimi-K2-like state dict's text is 48 MiB, its largest host's
    # part 19.7 MiB). A shorter one goes whole, once, to every agent that keeps it.
    slice_program_bytes: int = 1 * MiB
