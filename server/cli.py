"""The ``reshard`` command: plan, run an agent or the planner, start a local cluster, run the demo."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from reshard.plan_command import HelpFormatter, add_plan_command, non_negative_int, positive_float, positive_int
from reshard.client.cluster import describe_copies, die_with_parent
from reshard.errors import ReshardError
from reshard.proto.errors import InvalidArgumentError
from reshard.server.devtools.certs import add_certs_command
from reshard.server.devtools.lab import add_lab_command
from reshard.server.common.lifecycle import on_signal, settle_heap, settle_switching

__all__ = ["main", "build_parser"]

log = logging.getLogger(__name__)


def _add_security_arguments(p) -> None:
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help="file holding the cluster token every call must carry (default: $RESHARD_TOKEN, or the file "
                        "$RESHARD_TOKEN_FILE names; none: loopback callers only). See docs/security.md")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="this server's TLS certificate (reshard certs)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="the CA that signed every peer's certificate: with it, callers must present one (mutual TLS)")
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="check every server's certificate against NAME instead of the host dialled (one certificate "
                        "for peers dialled by address, e.g. Kubernetes pod IPs)")
    p.add_argument("--health-listen", default=None, metavar="ADDR",
                   help="also serve the gRPC health service alone, in plain text, on ADDR: for probes that cannot "
                        "speak TLS (Kubernetes' native gRPC probes)")


def _security(args) -> dict:
    from reshard.proto.auth import TlsFiles, resolve_token

    return {"token": resolve_token(token_file=args.token_file),
            "tls": TlsFiles.from_args(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)}


def _health_server(args, service: str):
    """The plaintext health-only server ``--health-listen`` asks for, or None."""
    from reshard.proto.status import serve_health

    return serve_health(args.health_listen, service)[0] if args.health_listen else None


def _rate(text: str) -> float:
    """A rate that is 0 (off) or positive."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value


def _size(text: str) -> int:
    from reshard.server.common.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_agent_command(sub) -> None:
    from reshard.server.common.config import AgentConfig

    d = AgentConfig("h", 1, "")
    p = sub.add_parser("agent", help="run a host's agent: holds shards and moves bytes",
                       formatter_class=HelpFormatter)
    p.add_argument("--planner", required=True, help="planner address, host:port")
    p.add_argument("--listen", default=d.listen, help="address to bind (port 0: any free port)")
    p.add_argument("--advertise", default=None, help="address peers dial (default: the bound address)")
    p.add_argument("--host", required=True, help="this host's name; devices are HOST/0 .. HOST/K-1")
    p.add_argument("--devices", type=positive_int, required=True, help="number of devices K")
    p.add_argument("--chunk-mib", type=positive_float, default=d.chunk_bytes / 2**20, help="gRPC stream chunk size")
    p.add_argument("--collective-chunk-mib", type=float, default=0.0,
                   help="collective and nixl transports' chunk size (0: about 3 ms at --nic-gbps, 2 to 16 MiB on "
                        "collective, 1 to 16 MiB on nixl)")
    p.add_argument("--collective-lanes", type=positive_int, default=d.collective_lanes,
                   help="collective and nixl transports: routes a host streams at once, and as many again for routes "
                        "under 1 MiB (default %(default)s; more let a host start a route while another waits for a "
                        "busy peer, each costs a thread and the bucket it may hold)")
    p.add_argument("--no-native-reduce", dest="native_reduce", action="store_false",
                   help="collective transport: run every reduce as the ring of XXH3-checked streams, never as "
                        "gloo's own all-reduce (which TCP's checksum alone covers)")
    p.add_argument("--nic-gbps", type=float, default=d.nic_gbps, help="NIC bandwidth reported to the planner")
    p.add_argument("--device-gflops", type=float, default=d.device_gflops,
                   help="one device's float32 GFLOP/s reported to the planner (0: measure at start)")
    p.add_argument("--memory-gbps", type=float, default=d.memory_gb_per_s,
                   help="one device's memory GB/s, read plus write, reported to the planner (0: measure at start)")
    p.add_argument("--emulate-gflops", type=_rate, default=d.emulate_gflops, metavar="GFLOPS",
                   help="emulate devices of this float32 rate, as the lab does for its hosts: each compute step lasts "
                        "at least its FLOPs at this rate, one at a time per device; reported to the planner "
                        "(0: off, kernels at this machine's speed)")
    p.add_argument("--compute-threads", type=non_negative_int, default=d.compute_threads, metavar="N",
                   help="threads one kernel (BLAS, OpenMP, torch) may use, and the computes an active transport "
                        "(collective, nixl) runs at once; 0: every core. Agents that share a machine should split "
                        "its cores (reshard up and local_cluster give each its share)")
    p.add_argument("--trace-dir", default=d.trace_dir, metavar="DIR",
                   help="append a line of JSON per task each job runs here (when each send, receive and kernel began "
                        "and ended) to DIR/<host>.jsonl, to see where a job's time went on each host: python -m "
                        "reshard.server.devtools.task_trace DIR (default: off)")
    p.add_argument("--rate-limit-mib-s", type=float, default=0.0,
                   help="cap this agent's send rate (0: none); for tests and demos")
    p.add_argument("--transport", choices=("grpc", "collective", "auto", "nixl"), default=d.transport,
                   help="what carries transfers between agents: gRPC streams, the torch.distributed process group "
                        "(needs torch), auto (the group when it is up, gRPC otherwise), or nixl (one-sided writes "
                        "over UCX: shared memory, TCP, RDMA; needs pip install 'reshard[nixl]', and every host of a "
                        "job on it)")
    p.add_argument("--nixl-backend", default=d.nixl_backend, metavar="PLUGIN",
                   help="nixl transport: NIXL's backend plugin")
    p.add_argument("--nixl-tcp-only", action="store_true",
                   help="nixl transport: UCX over TCP only (UCX_TLS=tcp), never shared memory, for hosts that share "
                        "a kernel but not a network (the emulated lab). UCX uses the interface of --listen either "
                        "way (UCX_NET_DEVICES); UCX_* variables already set are kept")
    p.add_argument("--device", default=d.device,
                   help="where this host's shards live: cpu (numpy arrays; gloo) or cuda[:N] (torch tensors on that "
                        "GPU; NCCL, one agent per GPU); checked at start")
    p.add_argument("--collective-timeout", type=float, default=d.collective_timeout_s,
                   help="seconds the plan-id confirmation before a collective phase, or a native all-reduce, may "
                        "take (a stream's sends and receives wait for their peer up to the transfer timeout, 300 s)")
    p.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                   help="seconds a gRPC push waits for a peer that takes none of its bytes (a paused or hung agent) "
                        "before it fails its job, naming the peer")
    p.add_argument("--memory-limit", type=_size, default=d.memory_limit_bytes, metavar="SIZE",
                   help="most bytes of shards this agent holds, committed and staged, with its programs' working "
                        "buffers (and, on a cpu agent, a reshard_many's bucket buffers in flight), e.g. 4GiB, 512MiB, "
                        "4G or bytes; a request or buffer over it is refused before it is allocated, and its job "
                        "fails leaving the stored tensors as they were (0: 3/4 of the machine's memory, or of the "
                        "GPU's for a cuda device)")
    p.add_argument("--no-cuda-ipc", dest="cuda_ipc", action="store_false",
                   help="on a cuda device: stream boxes to agents on this machine as bytes over gRPC instead of "
                        "handing them CUDA IPC handles to copy from on the GPU")
    p.add_argument("--fault", default="", choices=("", "corrupt-relay", "delta-base-differs"),
                   help=argparse.SUPPRESS)  # tests only
    p.add_argument("--report-gpu-uuid", default="", help=argparse.SUPPRESS)  # tests only
    _add_security_arguments(p)
    p.set_defaults(func=_run_agent)


def _run_agent(args) -> int:
    from reshard import delta as delta_codec
    from reshard.server.agent.service import Agent
    from reshard.server.common.config import AgentConfig

    config = AgentConfig(host=args.host, num_devices=args.devices, planner=args.planner, listen=args.listen,
                         advertise=args.advertise, chunk_bytes=int(args.chunk_mib * 2**20), nic_gbps=args.nic_gbps,
                         device_gflops=args.device_gflops, memory_gb_per_s=args.memory_gbps,
                         emulate_gflops=args.emulate_gflops,
                         compute_threads=args.compute_threads, rate_limit_bytes_per_s=args.rate_limit_mib_s * 2**20,
                         transport=args.transport, nixl_backend=args.nixl_backend,
                         nixl_tcp_only=args.nixl_tcp_only, device=args.device,
                         collective_timeout_s=args.collective_timeout,
                         stall_timeout_s=args.stall_timeout, cuda_ipc=args.cuda_ipc,
                         collective_chunk_bytes=int(args.collective_chunk_mib * 2**20),
                         collective_lanes=args.collective_lanes, native_reduce=args.native_reduce, fault=args.fault,
                         trace_dir=args.trace_dir,
                         report_gpu_uuid=args.report_gpu_uuid, memory_limit_bytes=args.memory_limit, **_security(args))
    agent = Agent(config).start()
    health = _health_server(args, "reshard.v1.Agent")
    stopped = on_signal()
    log.info("agent %s: %s", config.host, describe_copies())
    log.info("agent %s: delta codec %s", config.host, "compiled (reshard._delta_kernel)" if delta_codec.COMPILED else
             "numpy: the compiled passes were not built (pip builds them where a C compiler is on the PATH: install "
             "reshard again there for a few times less CPU per delta sync)")
    print(f"reshard agent {config.host} listening on {agent.address} "
          f"(devices {config.host}/0..{config.host}/{config.num_devices - 1})", flush=True)
    settle_heap()
    settle_switching()
    try:
        stopped()
    finally:
        if health is not None:
            health.stop(0)
        agent.stop()
    return 0


def _add_planner_command(sub) -> None:
    from reshard.server.common.config import PlannerConfig

    d = PlannerConfig()
    p = sub.add_parser("planner", help="run the planner service: registry, catalog and jobs",
                       formatter_class=HelpFormatter)
    p.add_argument("--listen", default=d.listen, help="address to bind (port 0: any free port)")
    p.add_argument("--state", default=None, help="SQLite file for tensors, pins, delta bases, jobs and plans, read "
                   "back at a restart (default: none; the plans alone are kept in memory, for the dashboard)")
    p.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s,
                   help="seconds without a heartbeat before an agent is down")
    p.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval_s,
                   help="seconds between an agent's heartbeats, which the planner tells every agent: the agents' "
                        "memory and health in the SDK and on the dashboard are this fresh; under --heartbeat-timeout")
    p.add_argument("--upload-timeout", type=float, default=d.upload_timeout_s,
                   help="seconds an idle upload is kept before its staged shards are dropped")
    p.add_argument("--pin-timeout-s", type=float, default=d.pin_timeout_s,
                   help="seconds a pin (c.pin(): a reader's hold on tensor versions) is kept without a read through "
                        "it before it expires and frees the older versions it held")
    p.add_argument("--no-delta", dest="delta", action="store_false",
                   help="no delta sync: every reshard_many moves each tensor whole, and the planner holds no delta "
                        "base pairs (otherwise each tensor a reshard_many moved keeps its last sync's two versions, "
                        "one per layout, on the agents until its next sync, or --pin-timeout-s unused)")
    p.add_argument("--job-timeout", type=float, default=d.job_timeout_s, help="seconds a reshard job may take")
    p.add_argument("--group-wait", type=float, default=d.group_wait_s,
                   help="seconds a job on --transport collective agents waits for their process group to form")
    p.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                   help="seconds a host may send no progress report for its part of a running job (while its "
                        "heartbeats go on) before the job fails, naming it; a host without heartbeats for "
                        "--heartbeat-timeout fails its jobs as soon as it is marked down")
    p.add_argument("--max-plan-tasks", type=int, default=d.max_plan_tasks, metavar="N",
                   help="largest plan one request may make: N unit tasks, N deliveries to devices, and for strategy "
                        "auto 256*N chain-route steps, summed over a reshard_many's distinct layouts (each planned "
                        "once); larger requests are refused before planning (reshard.plan_size)")
    p.add_argument("--max-program-steps", type=int, default=d.max_program_steps, metavar="N",
                   help="most steps one reshard_many program may hold (about 1 KiB of planner memory each); a job "
                        "whose planned layouts show more fails before its steps are made")
    p.add_argument("--slice-program-bytes", type=int, default=d.slice_program_bytes, metavar="N",
                   help="cut a program whose text is N bytes or more per host, each agent handed only its own steps "
                        "(0: every program; default %(default)s)")
    p.add_argument("--no-rendezvous", dest="rendezvous", action="store_false",
                   help="host no torch.distributed rendezvous store: every agent runs gRPC (one started with "
                        "--transport collective is refused, auto ones run gRPC), and the planner does not import "
                        "torch (otherwise it does, in the background: a second or more of CPU and about 200 MiB)")
    p.add_argument("--http", default=None, metavar="ADDR",
                   help="serve the admin dashboard on ADDR, e.g. 127.0.0.1:8080 (port 0: any free port)")
    p.add_argument("--admin-token-file", default=None, metavar="PATH",
                   help="file holding the token every dashboard page and API call must present")
    _add_security_arguments(p)
    p.set_defaults(func=_run_planner)


def _run_planner(args) -> int:
    from reshard.server.common.config import PlannerConfig
    from reshard.server.planner.service import serve_planner

    if not 0 < args.heartbeat_interval < args.heartbeat_timeout:
        raise InvalidArgumentError(f"--heartbeat-interval {args.heartbeat_interval:g} must be above 0 and under "
                                   f"--heartbeat-timeout ({args.heartbeat_timeout:g}), or the planner would take every "
                                   f"agent for down between two of its heartbeats")
    config = PlannerConfig(listen=args.listen, state_path=args.state, heartbeat_timeout_s=args.heartbeat_timeout,
                           heartbeat_interval_s=args.heartbeat_interval,
                           upload_timeout_s=args.upload_timeout, pin_timeout_s=args.pin_timeout_s,
                           job_timeout_s=args.job_timeout,
                           group_wait_s=args.group_wait, stall_timeout_s=args.stall_timeout,
                           max_plan_tasks=args.max_plan_tasks, max_program_steps=args.max_program_steps,
                           slice_program_bytes=args.slice_program_bytes, rendezvous=args.rendezvous, delta=args.delta,
                           **_security(args))
    token = None
    if args.http:
        from reshard.server.dashboard.source import read_token

        token = read_token(args.admin_token_file)
        if token is None:
            log.warning("the dashboard on %s has no admin token: anyone who can reach it can read it; "
                        "pass --admin-token-file", args.http)
    server, port, planner = serve_planner(config)
    host = config.listen.rsplit(":", 1)[0]
    dashboard = ""
    web = None
    if args.http:
        from reshard.server.dashboard.source import serve_dashboard

        web, http_port = serve_dashboard(planner, args.http, token)
        dashboard = f" (dashboard http://{args.http.rpartition(':')[0] or '127.0.0.1'}:{http_port}/)"
    health = _health_server(args, "reshard.v1.Planner")
    stopped = on_signal()
    print(f"reshard planner listening on {host}:{port}{dashboard}", flush=True)
    settle_heap()
    settle_switching()
    try:
        stopped()
    finally:
        if health is not None:
            health.stop(0)
        if web is not None:
            web.should_exit = True
        server.stop(1.0).wait()
        planner.close()
    return 0


def _add_up_command(sub) -> None:
    p = sub.add_parser("up", help="start a planner and N agents on this machine; Ctrl-C stops them all",
                       formatter_class=HelpFormatter)
    p.add_argument("--hosts", type=positive_int, default=2, help="number of agents (hosts host0..hostN-1)")
    p.add_argument("--devices-per-host", type=positive_int, default=4, help="devices per agent (HOST/0 ..)")
    p.add_argument("--state", default=None, help="planner state file (SQLite)")
    p.add_argument("--log-dir", default=None, help="where the processes log (default: a temporary folder)")
    p.add_argument("--transport", choices=("grpc", "collective", "auto", "nixl"), default="auto",
                   help="the agents' transport (see reshard agent --help)")
    p.add_argument("--device", default="cpu", metavar="DEVICE[,DEVICE...]",
                   help="where the agents' shards live: cpu, cuda:N for every agent, or one per agent in host order "
                        "(cuda:0,cuda:1); see reshard agent --help")
    p.set_defaults(func=_run_up)


def _run_up(args) -> int:
    import tempfile

    from reshard.client.cluster import LocalCluster

    devices = args.device.split(",")
    if len(devices) not in (1, args.hosts):
        raise InvalidArgumentError(f"--device names {len(devices)} devices for --hosts {args.hosts}: give one device "
                                   f"for every agent (--device cuda:0) or one per agent in host order")
    # A folder of our own, not a temporary one the cluster deletes: the logs outlive the cluster, as printed.
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="reshard-up-")
    planner_args = ["--state", args.state] if args.state else []
    cluster = None

    def report(event: str, name: str) -> None:
        proc = cluster.planner if name == "planner" else cluster.agents.get(name)
        pid = f"pid {proc.pid}" if proc is not None else ""
        if event == "listening" and name == "planner":
            print(f"planner  {cluster.address}  {pid}", flush=True)
        elif event == "listening":
            print(f"agent    {name:<8} {cluster.agent_addresses[name]}  {pid}  devices {name}/0..{name}/"
                  f"{args.devices_per_host - 1} on {cluster.device_of(name)}", flush=True)
        elif event == "registered":
            print(f"         {name} registered with the planner", flush=True)
        elif event == "stopping":
            print(f"stopping {name} ({pid})", flush=True)
        elif event == "stopped":
            print(f"stopped  {name} (exit code {proc.returncode})", flush=True)

    print(f"starting the planner, then {args.hosts} agents x {args.devices_per_host} devices, on loopback; logs in "
          f"{log_dir}", flush=True)
    cluster = LocalCluster(args.hosts, args.devices_per_host, planner_args=planner_args, log_dir=log_dir,
                           dashboard=True, transport=args.transport,
                           device=devices[0] if len(devices) == 1 else devices, on_event=report)
    try:
        cluster.start()
    except KeyboardInterrupt:  # start() has stopped what it started, and reported it
        print(f"interrupted while starting; logs kept in {log_dir}", file=sys.stderr)
        return 130
    try:
        stopped = on_signal()
        print(f"admin    {cluster.dashboard_login_url}")
        print(f"logs     {cluster.log_dir} (kept after the cluster stops)")
        print(f"token    {cluster.token_file} (the cluster token: export RESHARD_TOKEN_FILE={cluster.token_file})")
        print(f"connect with: reshard.connect({cluster.address!r}, token=open({str(cluster.token_file)!r}).read()); "
              f"Ctrl-C stops the cluster", flush=True)
        signum = stopped()
        print(f"{signal.Signals(signum).name}: stopping the cluster", flush=True)
    finally:
        cluster.stop()
    print(f"logs kept in {cluster.log_dir}", flush=True)
    return 0


def _add_demo_command(sub) -> None:
    from reshard.server.devtools.demo import add_demo_arguments, run_demo

    p = sub.add_parser("demo", help="run the paper's cases with every strategy through real agents",
                       formatter_class=HelpFormatter)
    add_demo_arguments(p)
    p.set_defaults(func=run_demo)


def _add_health_command(sub) -> None:
    p = sub.add_parser("health", help="ask a planner's or agent's gRPC health service whether it serves (exit 0) "
                                      "or not (exit 1): for container healthchecks", formatter_class=HelpFormatter)
    p.add_argument("address", help="the server's gRPC address, host:port (its --listen or --health-listen)")
    p.add_argument("--service", default="",
                   help="the service to ask about: reshard.v1.Planner, reshard.v1.Agent, or '' for the server")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="this caller's certificate (mutual TLS)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="the CA that signed the server's certificate")
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="check the server's certificate against NAME instead of the host dialled")
    p.set_defaults(func=_run_health)


def _run_health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from reshard.proto.auth import TlsFiles, channel

    tls = TlsFiles.from_args(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    with channel(args.address, tls=tls) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                         timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.address} {args.service or 'server'}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address} {args.service or 'server'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reshard", description="Cross-mesh resharding: plan, serve, move.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_command(sub)
    _add_agent_command(sub)
    _add_planner_command(sub)
    _add_up_command(sub)
    _add_demo_command(sub)
    add_lab_command(sub)
    add_certs_command(sub)
    _add_health_command(sub)
    return parser


def main(argv=None) -> int:
    die_with_parent()  # when a LocalCluster (reshard up, tests) started this process
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that left shows here, not as an error at exit
        return code
    except ReshardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # reshard plan ... | head: the reader has what it wanted
        return _quiet_broken_pipe()


def _quiet_broken_pipe() -> int:
    """Exit as a pipe's writer does when its reader left, without Python's traceback or a failed final flush."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
