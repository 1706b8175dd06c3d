"""The planner's gRPC face: the servicer, the calls it makes to agents, and its factory."""

from __future__ import annotations

import json
import threading
from concurrent import futures

import grpc

from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.status import SERVER_OPTIONS, domain_error, servicer_method, start_server
from reshard.proto.wire import box_to_pb
from reshard.server.common.torch_support import torch_available
from reshard.server.planner.rendezvous import Rendezvous
from reshard.server.common.config import PlannerConfig
from reshard.server.common.contract import GroupView, Staging
from reshard.server.planner.jobs import Job, Preparation
from reshard.server.planner.control import Planner

__all__ = ["serve_planner", "GrpcAgentCalls"]


def _prepare_request(p: Preparation) -> pb.PrepareRequest:
    return pb.PrepareRequest(job=p.job, program_json=p.program_json, tensor=p.tensor, src_version=p.src_version,
                             dst_version=p.dst_version, peers=p.peers, transport=p.transport,
                             generation=p.generation, job_seq=p.job_seq)


def _traffic(t: pb.HostTraffic) -> dict:
    return {"bytes_in": dict(t.bytes_in), "bytes_out": dict(t.bytes_out), "local_bytes": t.local_bytes}


class GrpcAgentCalls:
    """`AgentCalls` over gRPC: one cached channel per agent address."""

    def __init__(self):
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def _stub(self, address: str) -> pb_grpc.AgentStub:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = grpc.insecure_channel(address)
        return pb_grpc.AgentStub(ch)

    def _call(self, host: str, address: str, method: str, request, timeout: float):
        try:
            return getattr(self._stub(address), method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise domain_error(e, f"agent of host {host} at {address}") from None

    def prepare(self, host, address, prep, timeout):
        self._call(host, address, "Prepare", _prepare_request(prep), timeout)

    def execute(self, host, address, job, program_id, on_progress, timeout, prepare=None):
        request = pb.ExecuteRequest(job=job, program_id=program_id,
                                    prepare=_prepare_request(prepare) if prepare is not None else None)
        traffic = None
        try:
            for msg in self._stub(address).Execute(request, timeout=timeout):
                on_progress(msg.bytes_done, msg.bytes_total, msg.steps_done, msg.steps_total)
                if msg.HasField("traffic"):
                    traffic = _traffic(msg.traffic)
        except grpc.RpcError as e:
            raise domain_error(e, f"agent of host {host} at {address}") from None
        return traffic

    def commit(self, host, address, staging, tensor, version, devices, timeout):
        self._call(host, address, "Commit",
                   _staging(staging, tensor=tensor, version=version, devices=devices), timeout)

    def abort(self, host, address, staging, timeout):
        self._call(host, address, "Abort", _staging(staging), timeout)

    def release(self, host, address, tensor, version, timeout):
        self._call(host, address, "Release", pb.ReleaseRequest(tensor=tensor, version=version), timeout)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()


def _staging(staging: Staging, **fields) -> pb.StagingRequest:
    return pb.StagingRequest(upload_id=staging.upload, job_id=staging.job, **fields)


def _locations(items) -> list[pb.TileLocation]:
    return [pb.TileLocation(device=d, address=a, box=box_to_pb(b)) for d, a, b in items]


def job_info(job: Job) -> pb.JobInfo:
    return pb.JobInfo(
        id=job.id, tensor=job.tensor, state=job.state, error=job.error,
        plan_id=job.plan.id if job.plan else "", strategy=job.strategy,
        progress=[pb.AgentProgress(host=h, bytes_done=d, bytes_total=t) for h, (d, t) in sorted(job.progress.items())],
        traffic=[pb.HostTraffic(host=h, bytes_in=t["bytes_in"], bytes_out=t["bytes_out"], local_bytes=t["local_bytes"])
                 for h, t in sorted(job.traffic.items())],
        seconds=job.seconds, version=job.version, transport=job.transport, transports=job.transports)


def group_info(view: GroupView) -> pb.GroupInfo:
    return pb.GroupInfo(store_port=view.store_port, generation=view.generation, members=view.members,
                        backend=view.backend)


class PlannerServicer(pb_grpc.PlannerServicer):
    def __init__(self, planner: Planner):
        self.planner = planner

    @servicer_method
    def Register(self, request, context):
        self.planner.register(request.host, request.num_devices, request.address, request.nic_gbps,
                              request.transport, request.backend, request.device, request.gpu_uuid,
                              request.transport_reason)
        return pb.RegisterReply(heartbeat_interval_s=self.planner.config.heartbeat_interval_s,
                                group=group_info(self.planner.group.view()))

    @servicer_method
    def Heartbeat(self, request, context):
        known = self.planner.heartbeat(request.host, request.address, request.joined_generation,
                                       request.broken_generation, list(request.uploading))
        return pb.HeartbeatReply(known=known, group=group_info(self.planner.group.view()))

    @servicer_method
    def ListAgents(self, request, context):
        reg = self.planner.registry
        return pb.AgentList(agents=[
            pb.AgentInfo(host=r.host, address=r.address, num_devices=r.num_devices, up=reg.is_up(r),
                         heartbeat_age_s=reg.age(r), transport=self.planner.group.mode(r.host),
                         in_group=self.planner.group.in_group(r.host), device=r.device, gpu_uuid=r.gpu_uuid,
                         transport_reason=self.planner.group.reason(r.host)) for r in reg.agents()])

    @servicer_method
    def BeginUpload(self, request, context):
        upload, locations = self.planner.begin_upload(
            request.name, tuple(request.shape), request.dtype, request.sharding_json, request.kind,
            request.device, tuple(request.shard_shape))
        return pb.BeginUploadReply(upload_id=upload.id, version=upload.record.version, locations=_locations(locations))

    @servicer_method
    def FinishUpload(self, request, context):
        complete, missing = self.planner.finish_upload(request.upload_id, list(request.devices))
        return pb.FinishUploadReply(complete=complete, num_missing=missing)

    def _tensor_info(self, rec, locations=()) -> pb.TensorInfo:
        return pb.TensorInfo(name=rec.name, shape=rec.shape, dtype=rec.dtype, version=rec.version, kind=rec.kind,
                             sharding_json=json.dumps(rec.sharding.to_json(), sort_keys=True), locations=_locations(locations))

    @servicer_method
    def GetTensor(self, request, context):
        rec, locations = self.planner.tensor(request.name)
        return self._tensor_info(rec, locations)

    @servicer_method
    def ListTensors(self, request, context):
        return pb.TensorList(tensors=[self._tensor_info(r) for r in self.planner.tensors()])

    @servicer_method
    def DeleteTensor(self, request, context):
        self.planner.delete(request.name)
        return pb.Empty()

    @servicer_method
    def Plan(self, request, context):
        plan = self.planner.dry_plan(request.name, tuple(request.shape), request.dtype, request.src_json,
                                     request.dst_json, request.strategy)
        return pb.PlanReply(plan_json=plan.dumps())

    @servicer_method
    def Reshard(self, request, context):
        return job_info(self.planner.reshard(request.name, request.dst_json, request.strategy))

    @servicer_method
    def GetJob(self, request, context):
        return job_info(self.planner.job(request.job, request.wait_s))


def serve_planner(config: PlannerConfig) -> tuple[grpc.Server, int, Planner]:
    """Build and start the planner's gRPC server; returns (server, bound port, planner)."""
    agents = GrpcAgentCalls()
    rendezvous = None
    if config.rendezvous and torch_available():
        rendezvous = Rendezvous(config.listen.rsplit(":", 1)[0], config.group_wait_s)
    planner = Planner(config, agents, rendezvous.port if rendezvous else 0)
    planner.rendezvous = rendezvous  # the store lives as long as the planner
    if rendezvous is not None:
        planner.jobs.collective_cleanup = rendezvous.forget_job
    server = grpc.server(futures.ThreadPoolExecutor(config.max_workers, thread_name_prefix="planner"),
                         options=SERVER_OPTIONS)
    pb_grpc.add_PlannerServicer_to_server(PlannerServicer(planner), server)
    port = start_server(server, config.listen, "reshard.v1.Planner")
    return server, port, planner
