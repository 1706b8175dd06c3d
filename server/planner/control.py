"""The planner service's domain: registry, catalog, uploads and jobs behind one facade.

The servicer turns messages into calls on `Planner`; agent calls go through the
`AgentCalls` the service layer provides, so this module knows no gRPC.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from reshard.box import Box, box_str, volume
from reshard.dtypes import dtype_name, itemsize
from reshard.errors import InvalidMeshError, InvalidShardingError
from reshard.jsonio import loads
from reshard.manifest import Manifest
from reshard.mesh import host_of
from reshard.einsum import APPLY_OPS, EinsumError, plan_apply, plan_einsum
from reshard.sequence import Op, check_ops, plan_sequence
from reshard.partial_plan import reshard_program
from reshard.plans import Plan
from reshard.program import Program, TensorDecl
from reshard.many import DEFAULT_BUCKET_BYTES, MAX_BUCKET_BYTES, follow_scales, program_from_json, scale_pairs
from reshard.quantize import block_of, conversions, made_scale, scale_shape
from reshard.plan_size import ROUTE_STEPS_PER_TASK, estimate_plan_size, excess_text, layouts_plan_size
from reshard.strategies import STRATEGIES
from reshard.strategies import plan as make_plan
from reshard.proto.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from reshard.proto.layout import tile_shape
from reshard.server.common.contract import Staging
from reshard.server.common.sizes import format_size
from reshard.server.common.tickets import put_fields, sign
from reshard.server.planner.catalog import (Catalog, PinRecord, TensorRecord, Upload, Uploads, check_name,
                                            check_step, repeated_names)
from reshard.server.common.config import PlannerConfig
from reshard.server.planner.membership import NO_TORCH, GroupCoordinator
from reshard.server.planner.jobs import JOBS_KEPT, AgentCalls, Job, JobRunner, Planned, ProgramCache, planned_from
from reshard.server.planner.registry import AgentRecord, Registry
from reshard.server.planner.state import StateStore
from reshard.sharding import Sharding
from reshard.topology import Topology

__all__ = ["Planner", "RegisteredSync", "parse_sharding", "check_plan_size"]

log = logging.getLogger(__name__)

GENERATION = "process group generation"  # the state's counter of `GroupCoordinator` generations
_COMMITS_PER_CALL = 1000  # uploads of a put_many one Commit call to an agent carries (a few hundred KB)


SYNCS_KEPT = 64  # registered syncs a planner keeps (`Planner.register_sync`), least recently used dropped first
# reshard_many requests a planner remembers as checked (`Planner.reshard_many`), least recently used dropped first: a
# state dict's is its destinations by name (tens of MB at 139,583 tensors), so few
REPEATS_KEPT = 4


@dataclass(frozen=True)
class RegisteredSync:
    """A reshard_many request checked once, that a weight sync runs every step by ``id`` (`Planner.sync`)."""

    id: str
    request: tuple  # (targets, strategy, bucket_bytes, scales, manifest_json, dtypes), as registered
    args: dict  # what `JobRunner.submit_many` takes for it but the pin, step and delta (`Planner._many_job`)
    checked: tuple[int, int]  # `Catalog.declared` (`shapes`, where it quantizes) and `Registry.generation`, checked
    names: list[str]  # every tensor the job commits, in order (the job's ``inputs``)
    slots: np.ndarray  # their slots in the catalog's columns (`Catalog.slots`), worked out once
    # where it quantizes on the way: the tensors the catalog held as it was checked, as their slots (`Catalog.slots`),
    # and their dtypes then, as ids (`Catalog.dtype_ids`): its weights change dtype twice a step, which
    # `Catalog.shapes` leaves out, so a run compares them instead (`Catalog.same_dtypes`)
    seen: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, np.int64))

    @property
    def quantizes(self) -> bool:
        return bool(self.request[5])


def _request_digest(request: tuple) -> str:
    """A digest of reshard_many ``request`` (as `RegisteredSync.request`): equal for requests made alike, its
    targets in their order."""
    targets, strategy, bucket_bytes, scales, manifest_json, dtypes = request
    h = hashlib.blake2b(digest_size=20)
    h.update(json.dumps([strategy, bucket_bytes, scales, manifest_json, sorted(dtypes.items())]).encode())
    h.update("".join(f"{len(n)}:{n}{len(t)}:{t}" for n, t in targets).encode())
    return h.hexdigest()


class TileLocation(NamedTuple):
    device: str
    address: str  # of the agent holding the tile; "" when it is down
    box: Box
    ticket: str = ""  # uploads: the planner's ticket for the device's PutShard (reshard.server.common.tickets)
    lost: bool = False  # the agent that held it restarted: the bytes are gone


def parse_sharding(text: str, what: str, max_bytes: int = PlannerConfig.max_json_bytes,
                   max_depth: int = PlannerConfig.max_json_depth) -> Sharding:
    """The sharding in ``text`` (`Sharding.to_json`), read within the config's limits on JSON size and depth.

    Its mesh must list devices: the planner plans and places, and the chunks of an abstract mesh's axes (of any
    size, 2**40 say) are not to be counted out one by one."""
    if not text:
        raise InvalidShardingError(f"{what} is empty; give the JSON of a sharding (Sharding.to_json())")
    data = loads(text, what, max_bytes=max_bytes, max_depth=max_depth)
    try:
        sharding = Sharding.from_json(data)
        sharding.mesh.require_devices()
    except (InvalidShardingError, InvalidMeshError) as e:
        raise type(e)(f"{what}: {e}") from None
    return sharding


def check_plan_size(shape, src: Sharding, dst: Sharding, strategy: str, max_tasks: int, what: str) -> None:
    """Refuse, before planning, a request whose plan would be larger than ``max_tasks`` allows
    (`reshard.plan_size`), naming the count, the limit and the way out."""
    over = estimate_plan_size(shape, src, dst).excess(max_tasks, strategy)
    if not over:
        return
    figures = excess_text(over)
    other_strategy = ("use strategy broadcast or send_recv, which search no chain routes, "
                      if [f for f, _, _ in over] == ["route_steps"] else "")
    raise ResourceExhaustedError(
        f"{what} from {src} to {dst} would make too large a plan: {figures} (reshard planner --max-plan-tasks "
        f"{max_tasks:,} bounds unit tasks and deliveries, and route steps at {ROUTE_STEPS_PER_TASK} times that); "
        f"{other_strategy}reshard over fewer devices, in steps (within hosts first), or raise the limit")


def check_strategy(strategy: str) -> str:
    strategy = strategy or "auto"
    if strategy not in STRATEGIES:
        raise InvalidArgumentError(f"unknown strategy {strategy!r}; choose one of {list(STRATEGIES)}")
    return strategy


SEQUENCES_KEPT = 256  # compute programs kept: a pipeline step of 4 stages x 8 microbatches plans 64 and more
LAYOUTS_KEPT = 1024  # sharding texts kept read (`Planner._sharding`)
LAYOUT_TEXT_KEPT_BYTES = 64 * 1024  # a longer text (a mesh of thousands of devices) is read each time it comes


class Planner:
    def __init__(self, config: PlannerConfig, agents: AgentCalls, store_port: int = 0):
        """``config.delta`` False (--no-delta): the catalog holds no delta base pairs, and jobs move every tensor
        whole."""
        self.config = config
        self.agents = agents
        self.registry = Registry(config.heartbeat_timeout_s)
        self.store = StateStore(config.state_path)
        # Generations number on across restarts (--state): agents may still hold a group of the planner before this
        self.group = GroupCoordinator(self.registry, store_port, no_store=NO_TORCH if config.rendezvous else
                                      "it runs with --no-rendezvous", generation=self.store.counter(GENERATION),
                                      saved=lambda generation: self.store.save_counter(GENERATION, generation))
        self.catalog = Catalog(self.store, config.pin_timeout_s, delta=config.delta)
        self.catalog.restore()  # the current versions, the older ones pins and base pairs hold, the pins and pairs
        self.uploads = Uploads(self.catalog, config.upload_timeout_s)
        self.jobs = JobRunner(self.registry, self.catalog, self.store, agents, job_timeout_s=config.job_timeout_s,
                              rpc_timeout_s=config.agent_rpc_timeout_s, max_concurrent=config.max_concurrent_jobs,
                              group=self.group, group_wait_s=config.group_wait_s,
                              stall_timeout_s=config.stall_timeout_s, max_program_steps=config.max_program_steps,
                              slice_program_bytes=config.slice_program_bytes)
        self._sequences = ProgramCache(SEQUENCES_KEPT)  # compute programs (einsum, apply, compute_many), `_planned`
        self._layouts_lock = threading.Lock()
        self._layouts: OrderedDict[str, Sharding] = OrderedDict()  # sharding text -> its sharding, `_sharding`
        self._by_layout: dict[Sharding, Sharding] = {}  # each layout read, as the one object that stands for it
        self._syncs_lock = threading.Lock()
        self._syncs: OrderedDict[str, RegisteredSync] = OrderedDict()  # registered syncs, most recently used last
        # reshard_many requests checked, by their digest (`_repeated`), most recently used last
        self._repeats: OrderedDict[str, RegisteredSync] = OrderedDict()
        self._upload_lock = threading.Lock()
        self._commit_pool = ThreadPoolExecutor(8, thread_name_prefix="upload-commit")  # one host's commits each
        # The versions a commit superseded are freed on their agents here, after the caller has its reply (a
        # release call was a millisecond of every put of a next version); one at a time, in order.
        self._release_pool = ThreadPoolExecutor(1, thread_name_prefix="upload-release")
        self._releases_lock = threading.Lock()
        self._releases: dict[str, Future] = {}  # tensor -> the release of its superseded versions under way
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, daemon=True, name="upload-reaper")
        self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        self._commit_pool.shutdown(wait=False)
        self._release_pool.shutdown(wait=False)

    def _sharding(self, text: str, what: str) -> Sharding:
        """The sharding of ``text``, read once per text and kept as one object per layout (`LAYOUTS_KEPT`): a
        weight sync names the same few layouts for hundreds of tensors every step, and when the records, the
        jobs and the program cache's keys share those objects, comparing and hashing them is an identity check."""
        with self._layouts_lock:
            kept = self._layouts.get(text)
            if kept is not None:
                self._layouts.move_to_end(text)
                return kept
        sharding = parse_sharding(text, what, self.config.max_json_bytes, self.config.max_json_depth)
        with self._layouts_lock:
            sharding = self._layouts.get(text) or self._by_layout.setdefault(sharding, sharding)
            if len(text) <= LAYOUT_TEXT_KEPT_BYTES:
                self._layouts[text] = sharding
                while len(self._layouts) > LAYOUTS_KEPT:
                    self._layouts.popitem(last=False)
            if len(self._by_layout) > 2 * LAYOUTS_KEPT:  # texts come and go (long ones are not kept): so do layouts
                self._by_layout = {s: s for s in self._layouts.values()}
        return sharding

    # -- registry ------------------------------------------------------------------------

    def register(self, host: str, num_devices: int, address: str, nic_gbps: float, transport: str = "grpc",
                 backend: str = "gloo", device: str = "cpu", gpu_uuid: str = "",
                 transport_reason: str = "", secret: bytes = b"", memory_limit_bytes: int = 0,
                 held: Iterable[tuple[str, int]] = (), device_gflops: float = 0.0,
                 memory_gb_per_s: float = 0.0, nixl_metadata: bytes = b"") -> AgentRecord:
        """Admit an agent; the group's checks run first, so an agent they refuse never shows as up.

        ``secret`` binds the host name to this agent while it is up (another registrant is refused) and
        keys the tickets of the calls the planner makes to it. ``held`` lists the tensor versions the agent
        holds: the host's shards of every other catalogued version are lost (a restarted agent holds none,
        also one that restarted while the planner was down), and those it holds are not. ``nixl_metadata`` is
        what the agent's NIXL transport tells its peers (``--transport nixl``), handed to the other hosts of its
        nixl jobs.
        """
        self.registry.check(host, secret)
        if transport == "nixl" and not nixl_metadata:
            raise InvalidArgumentError(f"host {host} registers the nixl transport without its NIXL metadata; an "
                                       f"agent started with --transport nixl sends it")
        before = self.registry.get(host)
        admitted: list[AgentRecord] = []
        self.group.register(host, transport, backend, gpu_uuid, transport_reason, admit=lambda: admitted.append(
            self.registry.register(host, num_devices, address, nic_gbps, device, gpu_uuid, secret,
                                   memory_limit_bytes, device_gflops, memory_gb_per_s, nixl_metadata)))
        self._reconcile(host, held)
        if before is not None and before.address != address:
            self.agents.forget(before.address)
        log.info("agent of host %s registered at %s with %d devices on %s (transport %s)", host, address,
                 num_devices, device or "cpu", self.group.mode(host))
        return admitted[0]

    def _reconcile(self, host: str, held: Iterable[tuple[str, int]]) -> None:
        """Mark lost the shards of ``host`` its agent no longer holds (and found the ones it holds again)."""
        changed = self.catalog.reconcile(host, set(held))
        for rec in changed:
            self.store.save_tensor(rec.name, rec.json_text())
            if not self.catalog.contains(rec.name):  # deleted meanwhile: keep it deleted after a restart too
                self.store.delete_tensor(rec.name)
        lost = [r.name for r in changed if host in {d.split("/")[0] for d in r.lost}]
        if lost:
            log.warning("the agent of host %s does not hold its shards of %s (it restarted): they are lost; "
                        "tensors %s lost every copy of some tile", host, lost, [r.name for r in changed
                                                                              if r.lost_tiles()])

    def heartbeat(self, host: str, address: str, joined_generation: int = 0, broken_generation: int = 0,
                  uploading: Iterable[str] = (), proof: str = "", memory_used_bytes: int = 0) -> bool:
        """Record an agent's heartbeat; ``uploading`` names uploads streaming into it, which are not idle.
        ``proof`` signs the host and address with its registration secret."""
        known = self.registry.heartbeat(host, address, proof, memory_used_bytes)
        if known:
            self.group.heartbeat(host, joined_generation, broken_generation)
            self.uploads.touch(uploading)
        return known

    def bytes_moved(self) -> dict[str, int]:
        """Bytes moved by succeeded jobs, by transport: ``grpc``, ``collective`` (network), ``local`` (within a host)."""
        return self.jobs.bytes_moved()

    def _check_memory(self, sharding: Sharding, shape: tuple[int, ...], dtype: str, what: str) -> None:
        """Refuse tiles that would not fit their host's memory limit, one device's alone or the host's together,
        before any agent is asked (the agent checks again against what it holds: `ShardStore.reserve`)."""
        size = itemsize(dtype_name(dtype))
        by_host: dict[str, list[tuple[int, str]]] = {}
        for dev, tile in sharding.tiles(shape).items():
            by_host.setdefault(host_of(dev), []).append((volume(tile) * size, dev))
        for host, tiles in by_host.items():
            agent = self.registry.get(host)
            limit = agent.memory_limit_bytes if agent is not None else 0
            largest, dev = max(tiles)
            total = sum(n for n, _ in tiles)
            if not limit or total <= limit:
                continue
            need = (f"device {dev} a tile of {format_size(largest)} ({largest:,} bytes)" if largest > limit else
                    f"{len(tiles)} devices {format_size(total)} ({total:,} bytes) together")
            raise ResourceExhaustedError(
                f"{what} of shape {tuple(shape)} {dtype} on {sharding} would give host {host}'s {need}, more than its "
                f"agent's memory limit of {format_size(limit)} ({limit:,} bytes); shard it over more devices or "
                f"hosts, or start that agent with a larger --memory-limit")

    def _upload_locations(self, upload: Upload, devices: Collection[str] | None = None) -> list[TileLocation]:
        """Where each device's shard goes (of ``devices`` only, when given), with the ticket its PutShard must
        carry."""
        rec = upload.record
        tiles = rec.sharding.tiles(rec.shape)
        out = []
        for d in rec.sharding.mesh.require_devices():
            if devices is not None and d not in devices:
                continue
            agent = self.registry.require_up(host_of(d))
            ticket = sign(agent.secret, "put", *put_fields(upload.id, rec.name, d, rec.dtype, tiles[d]))
            out.append(TileLocation(d, agent.address, tiles[d], ticket))
        return out

    # -- uploads -----------------------------------------------------------------------------

    def begin_upload(self, name: str, shape, dtype: str, sharding_json: str, kind: str,
                     device: str = "", shard_shape=(), step: int | None = None) -> tuple[Upload, list[TileLocation]]:
        """Open an upload of ``name`` (its next version when it exists), labeled ``step``."""
        sharding = self._sharding(sharding_json, "sharding")
        sharding.check_shape(shape)
        self.registry.check_mesh(sharding.mesh)
        if sharding.is_partial and not device:
            raise InvalidArgumentError(
                f"sharding {sharding} is Partial: its devices hold addends that sum to the value, and put hands over "
                f"the value itself; put it in {sharding.without_partial()}, or hand each device its addends with "
                f"put_shard")
        if device:
            tiles = sharding.tiles(tuple(shape))
            if device not in tiles:
                raise InvalidArgumentError(
                    f"device {device!r} is not in the mesh of sharding {sharding}; its devices are {list(tiles)}"
                )
            want = tile_shape(tiles[device])
            if tuple(shard_shape) != want:
                raise InvalidArgumentError(
                    f"shard for device {device} has shape {tuple(shard_shape)}, but {sharding.spec_str()} of shape "
                    f"{tuple(shape)} gives it the tile {list(tiles[device])} of shape {want}"
                )
        self._check_memory(sharding, sharding.check_shape(shape), dtype, f"tensor {name!r}")
        self._released([name])
        upload = self.uploads.begin(name, shape, dtype, sharding, kind or "numpy", per_shard=bool(device), step=step)
        return upload, self._upload_locations(upload)

    def finish_upload(self, upload_id: str, devices) -> tuple[bool, int]:
        upload, complete = self.uploads.mark(upload_id, devices)
        if not complete:
            return False, len(upload.devices) - len(upload.done)
        with self._upload_lock:
            self.uploads.get(upload_id)  # still open: not expired meanwhile
            try:
                self._commit_uploads([upload])
            finally:
                self.uploads.close(upload_id)
        return True, 0

    def begin_uploads(self, tensors: list[tuple[str, tuple, str, str, str]], step: int | None = None, key: str = "",
                      devices: Collection[str] = ()) -> tuple[str, list[tuple[Upload, list[TileLocation]]]]:
        """Open a put_many: an upload of every (name, shape, dtype, sharding JSON, kind), each labeled ``step``,
        all committed at once by `finish_uploads`.

        With a ``key``, open (or join, when a caller opened it with the same key) a group shared by the ranks of
        one publish: each hands over the shards of its own ``devices`` (the locations returned are theirs only;
        a Partial sharding's devices hand over addends) and marks them done, and the group commits when every
        device of every tensor is in."""
        if key and (len(key) > 64 or not key.isprintable()):
            raise InvalidArgumentError(f"group key {key[:80]!r} must be at most 64 printable characters (a random "
                                       f"hex string every rank of the publish shares)")
        if devices and not key:
            raise InvalidArgumentError("devices= names a caller's share of a group opened by a key; a put_many "
                                       "hands over every device's shard itself")
        if not tensors:
            raise InvalidArgumentError("put_many needs at least one tensor; got none")
        if len(tensors) > self.config.max_plan_tasks:
            raise ResourceExhaustedError(f"put_many of {len(tensors):,} tensors is more than the planner takes in one "
                                         f"transaction ({self.config.max_plan_tasks:,}, --max-plan-tasks); split it")
        parsed = []
        for name, shape, dtype, sharding_json, kind in tensors:
            sharding = self._sharding(sharding_json, f"sharding of {name!r}")
            shape = sharding.check_shape(shape)
            self.registry.check_mesh(sharding.mesh)
            if sharding.is_partial and not key:
                raise InvalidArgumentError(
                    f"sharding of {name!r} {sharding} is Partial: its devices hold addends that sum to the value, and "
                    f"put_many hands over values; put it in {sharding.without_partial()}")
            parsed.append((name, shape, dtype, sharding, kind or "numpy"))
        self._check_memory_together([(sharding, shape, dtype, f"tensor {name!r}") for name, shape, dtype, sharding, _
                                     in parsed], f"put_many of {len(parsed)} tensors")
        self._released(name for name, *_ in parsed)
        group, uploads = self.uploads.begin_group(parsed, step, key)
        mine = set(devices) if key else None
        return group, [(up, self._upload_locations(up, mine)) for up in uploads]

    def finish_uploads(self, group: str, done: list[tuple[str, list[str]]] = (), wait_s: float = 0.0
                       ) -> tuple[bool, int]:
        """Commit every upload of put_many ``group``: all its tensors enter the catalog together, or none does.
        Returns (committed, devices still missing).

        A shared group (opened by a key) takes each caller's ``done`` devices (upload id, devices); the call that
        brings in the last device commits it, and the others wait up to ``wait_s`` for that outcome: committed,
        or the error it failed with (FailedPreconditionError naming it, e.g. the devices that never came)."""
        if not self.uploads.is_shared(group):
            if done:
                raise InvalidArgumentError(f"group {group[:8]} is a put_many, which hands over every shard itself: "
                                           f"finish it without devices")
            with self._upload_lock:
                uploads = self.uploads.group(group)
                try:
                    self._commit_uploads(uploads)
                finally:
                    self.uploads.close_group(group)
            return True, 0
        uploads, commit, missing = self.uploads.mark_group(group, list(done)) if done else ([], False, None)
        if commit:
            error = "it was interrupted"
            with self._upload_lock:
                try:
                    self.uploads.group(group)  # still open: not expired meanwhile
                    self._commit_uploads(uploads)
                    error = ""
                except Exception as e:
                    error = f"committing upload group {group[:8]} failed: {e}"
                    raise
                finally:
                    self.uploads.close_group(group, error)
            return True, 0
        outcome = self.uploads.outcome(group, min(wait_s, self.config.max_wait_s))
        if outcome is None:
            return False, len(self.uploads.missing(group) if missing is None else missing)
        if outcome:
            raise FailedPreconditionError(outcome)
        return True, 0

    def _commit_uploads(self, uploads: list[Upload]) -> None:
        """Number the uploads' versions, commit their staged shards on their agents (hosts at once), then publish
        every tensor in the catalog in one step and hand the versions they superseded (unless pinned) to
        `_release_later`; on any failure nothing stays: committed shards are released and staged ones dropped."""
        with self.catalog.publishing([up.record.name for up in uploads]) as versions:
            for up in uploads:
                if up.record.version != versions[up.record.name]:
                    up.record = replace(up.record, version=versions[up.record.name])
            freed = self._publish(uploads)
        if freed:
            self._release_later(freed)

    def _release_later(self, freed: list[TensorRecord]) -> None:
        """Free ``freed`` on their agents after the caller has its reply (best effort: `JobRunner.release` logs a
        host's failure). The next upload of one of their tensors waits for it (`_released`), so that a tensor put
        every step holds no more versions on its agents than before."""
        future = self._release_pool.submit(self.jobs.release, *freed)
        names = {rec.name for rec in freed}
        with self._releases_lock:
            self._releases.update(dict.fromkeys(names, future))

        def forget(done: Future) -> None:
            with self._releases_lock:
                for name in names:
                    if self._releases.get(name) is done:
                        del self._releases[name]

        future.add_done_callback(forget)

    def _released(self, names: Iterable[str]) -> None:
        """Wait until the versions a commit superseded of any of ``names`` are freed on their agents."""
        if not self._releases:  # nothing under way: no lock, no look at each name
            return
        with self._releases_lock:
            pending = {f for name in names if (f := self._releases.get(name)) is not None}
        for f in pending:
            f.result()

    def _publish(self, uploads: list[Upload]) -> list[TensorRecord]:
        """`_commit_uploads` once the versions are numbered; returns the versions it made free."""
        by_host: dict[str, list[tuple[Upload, list[str]]]] = {}
        for up in uploads:
            devices: dict[str, list[str]] = {}
            for d in up.devices:
                devices.setdefault(host_of(d), []).append(d)
            for h, devs in devices.items():
                by_host.setdefault(h, []).append((up, devs))
        committed: dict[str, set[str]] = {up.id: set() for up in uploads}  # upload -> hosts that committed it

        def commit(h: str) -> None:
            address = self.registry.require_up(h).address
            items = by_host[h]
            for start in range(0, len(items), _COMMITS_PER_CALL):
                batch = items[start:start + _COMMITS_PER_CALL]
                for up, _ in batch:  # a failed call may have committed some: the cleanup releases them all
                    committed[up.id].add(h)
                (first, devs), more = batch[0], batch[1:]
                self.agents.commit(h, address, Staging(upload=first.id), first.record.name, first.record.version,
                                   devs, self.config.agent_rpc_timeout_s,
                                   [(up.id, up.record.name, up.record.version, d) for up, d in more])

        try:
            if len(by_host) == 1:  # called here: handing one call to the pool and back cost two thread switches
                commit(next(iter(by_host)))
            else:
                for f in [self._commit_pool.submit(commit, h) for h in by_host]:
                    f.result()
            freed = self.catalog.commit([(None, up.record) for up in uploads])
        except BaseException:
            self._drop_uploads(uploads, committed)
            raise
        if self.store.durable:
            self.store.save_tensors([(up.record.name, up.record.json_text()) for up in uploads])
        return freed

    def _drop_upload(self, upload: Upload) -> None:
        self._drop_uploads([upload], {})

    def _drop_uploads(self, uploads: list[Upload], committed: dict[str, set[str]]) -> None:
        """Free what ``uploads`` left on their agents: the versions committed on the hosts of ``committed`` (upload
        id -> hosts that may have committed it), and every staged shard. A few calls per host, however many uploads
        (a failed put_many of thousands of tensors); a host whose call fails gets no more, since a paused agent would
        make each wait its timeout (a restarted one holds nothing staged)."""
        by_host: dict[str, list[Upload]] = {}
        for up in uploads:
            for h in up.record.sharding.mesh.hosts:
                by_host.setdefault(h, []).append(up)
        for h, ups in by_host.items():
            agent = self.registry.get(h)
            if agent is None:
                continue
            try:
                for start in range(0, len(ups), _COMMITS_PER_CALL):
                    first, *more = batch = ups[start:start + _COMMITS_PER_CALL]
                    versions = [(up.record.name, up.record.version) for up in batch if h in committed.get(up.id, ())]
                    if versions:
                        self.agents.release(h, agent.address, versions, self.config.agent_rpc_timeout_s)
                    self.agents.abort(h, agent.address, Staging(upload=first.id), self.config.agent_rpc_timeout_s,
                                      [up.id for up in more])
            except Exception as e:  # noqa: BLE001 - cleanup continues on the other hosts
                log.info("dropping %d uploads (%s, ...) on host %s failed: %s", len(ups), ups[0].id[:8], h, e)

    def _reap(self) -> None:
        while not self._stop.wait(min(1.0, self.config.upload_timeout_s / 4)):
            for up in self.uploads.expired():
                log.warning("upload of %r expired after %gs without activity; dropping its staged shards",
                            up.record.name, self.config.upload_timeout_s)
                self._drop_upload(up)
            expired, freed = self.catalog.expired_pins()
            if expired:
                log.warning("pins %s expired after %gs without a read; %d versions they held are freed",
                            [p[:8] for p in expired], self.config.pin_timeout_s, len(freed))
            if freed:
                self.jobs.release(*freed)
            expired, freed = self.catalog.expired_bases()
            if expired:
                log.info("delta base pairs of %d tensors (%s, ...) expired after %gs unused; %d versions they held "
                         "are freed", len(expired), expired[0], self.config.pin_timeout_s, len(freed))
            if freed:
                self.jobs.release(*freed)

    # -- catalog ---------------------------------------------------------------------------------

    def tensor(self, name: str, pin: str = "", step: int | None = None) -> tuple[TensorRecord, list[TileLocation]]:
        """``name``'s current version, or the one pin ``pin`` holds, or the one labeled ``step``, with its tiles."""
        if not pin and step is None:
            return self._located(self.catalog.get(name))
        return self._located(self.catalog.resolve([name], pin, step)[0])

    def tensors_at_once(self, names: list[str], pin: str = "", step: int | None = None
                        ) -> list[tuple[TensorRecord, list[TileLocation]]]:
        """Several tensors as the catalog holds them at one instant (`Catalog.snapshot`), or the versions pin
        ``pin`` holds or step ``step`` labels (`Catalog.resolve`), each with its tiles."""
        return [self._located(rec) for rec in self.catalog.resolve(list(dict.fromkeys(names)), pin, step)]

    def pin(self, names: list[str] | None, step: int | None = None) -> PinRecord:
        """Pin, for each of ``names`` (None: every tensor), its current version or the one labeled ``step``."""
        return self.catalog.pin(names, check_step(step))

    def release_pin(self, pin_id: str) -> None:
        """Let go of a pin (idempotent), freeing on their agents the older versions no other pin holds."""
        freed = self.catalog.release_pin(pin_id)
        if freed:
            self.jobs.release(*freed)

    def versions(self, name: str) -> list[tuple[TensorRecord, int]]:
        """Every version of ``name`` held, current last, with the pins on each."""
        return self.catalog.versions(name)

    def _located(self, rec: TensorRecord) -> tuple[TensorRecord, list[TileLocation]]:
        tiles = rec.sharding.tiles(rec.shape)
        out = []
        for d in rec.sharding.mesh.require_devices():
            agent = self.registry.get(host_of(d))
            up = agent is not None and self.registry.is_up(agent)
            out.append(TileLocation(d, agent.address if up else "", tiles[d], lost=d in rec.lost))
        return rec, out

    def tensors(self) -> list[TensorRecord]:
        return self.catalog.list()

    def delete(self, name: str) -> None:
        self.delete_many([name])

    def delete_many(self, names: list[str]) -> None:
        """Take ``names`` out of the catalog, each with its base pair (a version a pin holds stays readable through
        it), and free their versions with one call per host, not one per tensor (a state dict deleted name by name
        cost 4 ms a tensor, all of it in its hosts' release calls). All or none: an unknown name, one named twice,
        or one in a queued or running job is refused before any is deleted."""
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise InvalidArgumentError(f"tensor {name!r} is named twice in one delete")
            seen.add(name)
        none = f" (none of the {len(names)} was deleted)" if len(names) > 1 else ""
        if len(names) > 1:  # one name: the catalog's own refusal says it
            missing = next((n for n in names if not self.catalog.contains(n)), None)
            if missing is not None:
                raise NotFoundError(f"no tensor named {missing!r} to delete{none}")
        busy = self.jobs.busy_of(seen)
        if busy:
            first = next(n for n in names if n in busy)
            raise FailedPreconditionError(f"tensor {first!r} has a reshard job queued or running; wait for it first"
                                          f"{none}")
        freed: list = []
        gone: list[str] = []
        try:
            for name in names:
                freed += self.catalog.delete(name)[1]
                gone.append(name)
        finally:  # a name another caller deleted meanwhile ends the loop: what was deleted stays deleted and freed
            if gone:
                self.store.delete_tensors(gone)
            if freed:
                self.jobs.release(*freed)  # best effort: the entries are gone; memory is reclaimed on restart

    # -- planning and jobs -------------------------------------------------------------------------

    def dry_plan(self, name: str, shape, dtype: str, src_json: str, dst_json: str, strategy: str) -> Plan:
        """The plan a reshard would run (saved, so the dashboard shows dry runs as well as jobs)."""
        return self.dry_plan_json(name, shape, dtype, src_json, dst_json, strategy)[0]

    def dry_plan_json(self, name: str, shape, dtype: str, src_json: str, dst_json: str,
                      strategy: str) -> tuple[Plan, str]:
        """`dry_plan` and the plan's JSON, serialised once for the store and the reply: a large plan takes
        seconds to serialise."""
        dst = self._sharding(dst_json, "destination sharding")
        if name:
            rec = self.catalog.get(name)
            shape, dtype, src = rec.shape, rec.dtype, rec.sharding
        else:
            src = self._sharding(src_json, "source sharding")
        strategy = check_strategy(strategy)
        shape = dst.check_shape(src.check_shape(shape))
        check_plan_size(shape, src, dst, strategy, self.config.max_plan_tasks,
                        f"planning {name or 'a tensor'} of shape {shape}")
        plan = make_plan(tuple(shape), dtype, src, dst, self.registry.topology(), strategy).validate()
        # Kept so that the dashboard can show dry runs as well as jobs.
        text = plan.dumps()
        self.store.save_plan(plan.id, text)
        return plan, text

    def stored_plan(self, plan_id: str) -> Plan | None:
        doc = self.store.plan(plan_id)
        return Plan.from_json(doc) if doc else None

    def stored_program(self, program_id: str) -> Program | None:
        """The saved plan or program of that id, as a program (a plan is a program of moves)."""
        doc = self.store.plan(program_id)
        return program_from_json(doc) if doc else None

    # -- compute ---------------------------------------------------------------------------------

    def _check_op(self, op: str, inputs: list[str], out: str, out_sharding_json: str, params: dict[str, str],
                  where: str = "") -> Sharding | None:
        """Refuse a compute op that names no input, an unknown op, an einsum without its equation, or a bad output
        name or sharding (``where`` names the op in a sequence); returns its out_sharding."""
        if not inputs:
            raise InvalidArgumentError(f"{where}{op or 'compute'} needs input tensors; none given")
        if op == "einsum":
            if not params.get("equation"):
                raise InvalidArgumentError(f"{where}einsum needs params['equation'], in numpy notation such as "
                                           f"'ij,jk->ik'")
        elif op not in APPLY_OPS:
            raise InvalidArgumentError(f"{where}unknown op {op!r}; compute runs 'einsum' or one of "
                                       f"{list(APPLY_OPS)}")
        check_name(out)
        out_sharding = self._sharding(out_sharding_json, f"{where}out_sharding") if out_sharding_json else None
        if out_sharding is not None:
            self.registry.check_mesh(out_sharding.mesh)
        return out_sharding

    def _planned(self, key: tuple, plan: Callable[[], Program]) -> Program:
        """The compute program planned before for ``key`` (what was asked, the inputs' declarations, the topology),
        else ``plan()``'s, kept: the same request on the same layouts always plans the same program."""
        hit = self._sequences.get(key)
        return hit[0] if hit is not None else self._sequences.put(key, plan())[0]

    def _compute_planner(self, op: str, inputs: list[str], out: str, out_sharding_json: str, strategy: str,
                         params: dict[str, str]) -> Callable[[dict[str, TensorRecord], Topology], Program]:
        """Check a compute request and return what plans it from the inputs' records (the same records give the
        same program, planned once)."""
        out_sharding = self._check_op(op, inputs, out, out_sharding_json, params)
        strategy = check_strategy(strategy)
        # The program names the output apart from an input of the same name: the input's version is read, and the
        # output commits as that tensor's next version.
        program_out = out if out not in inputs else f"{out}~new"
        described = (op, tuple(inputs), program_out, out_sharding, tuple(sorted(params.items())), strategy)

        def make(records: dict[str, TensorRecord], topology: Topology) -> Program:
            # The same op on the same layouts plans the same program: a training loop repeats its applies and
            # einsums every step, and the request's check and its job plan once between them (as compute_many).
            decls = tuple(TensorDecl(n, records[n].shape, records[n].dtype, records[n].sharding) for n in inputs)

            def plan() -> Program:
                if op == "einsum":
                    return plan_einsum(params["equation"], list(decls), program_out, out_sharding, topology, strategy)
                return plan_apply(op, list(decls), program_out, params, out_sharding, topology, strategy)

            return self._planned((described, decls, topology), plan)

        return make

    def _compute_inputs(self, inputs: list[str]) -> dict[str, TensorRecord]:
        records = {n: self.catalog.get(n) for n in dict.fromkeys(inputs)}
        for rec in records.values():
            self._check_not_lost(rec)
        return records

    def plan_compute(self, op: str, inputs: list[str], out: str, out_sharding_json: str, strategy: str,
                     params: dict[str, str]) -> tuple[Program, str]:
        """The program a compute job would run now, and its JSON (saved, so the dashboard shows dry runs)."""
        make = self._compute_planner(op, inputs, out, out_sharding_json, strategy, params)
        program = make(self._compute_inputs(inputs), self.registry.topology())
        text = program.dumps()
        self.store.save_plan(program.id, text)
        return program, text

    def compute(self, op: str, inputs: list[str], out: str, out_sharding_json: str, strategy: str,
                params: dict[str, str]) -> Job:
        """Queue a compute job; planned here first, so a request the planner cannot run is refused at once, and
        the job runs that program unless a job before it changes what it was planned from (`Planned`)."""
        make = self._compute_planner(op, inputs, out, out_sharding_json, strategy, params)
        records, topology = self._compute_inputs(inputs), self.registry.topology()
        program = make(records, topology)
        result = next(t for t in program.tensors if t.dst is not None)
        self._check_memory(result.dst, result.shape, result.dtype, f"the output {out!r} of {op}")
        return self.jobs.submit_compute(op, list(inputs), out, check_strategy(strategy), make,
                                        planned=Planned(program, planned_from(records.values(), topology)))

    def _sequence_planner(self, ops: list[tuple[str, list[str], str, str, dict[str, str]]], strategy: str
                          ) -> tuple[list[Op], list[str], Callable[[dict[str, TensorRecord], Topology], Program]]:
        """Check a compute_many request (each op: op, inputs, out, out_sharding JSON, params) and return its ops,
        the catalog tensors it reads, and what plans it from their records (`reshard.sequence`)."""
        if not ops:
            raise InvalidArgumentError("compute_many needs at least one op; got none")
        if len(ops) > self.config.max_plan_tasks:
            raise ResourceExhaustedError(f"compute_many of {len(ops):,} ops is more than the planner takes in one "
                                         f"job ({self.config.max_plan_tasks:,}, --max-plan-tasks); split it")
        parsed, stored, written = [], [], set()
        for k, (op, inputs, out, out_sharding_json, params) in enumerate(ops):
            out_sharding = self._check_op(op, inputs, out, out_sharding_json, params, f"op {k} of compute_many: ")
            stored += [n for n in inputs if n not in written]
            written.add(out)
            parsed.append(Op(op, tuple(inputs), out, out_sharding, dict(params)))
        try:
            check_ops(parsed)
        except EinsumError as e:
            raise InvalidArgumentError(f"compute_many: {e}") from None
        stored = list(dict.fromkeys(stored))
        described = tuple((op.op, op.inputs, op.out, op.out_sharding, tuple(sorted(op.params.items())))
                          for op in parsed)

        def make(records: dict[str, TensorRecord], topology: Topology) -> Program:
            decls = {n: TensorDecl(n, r.shape, r.dtype, r.sharding) for n, r in records.items()}
            # The same ops on the same layouts plan the same program: a pipeline repeats each stage's forward and
            # backward every step, and the request's check and its job plan once between them.
            return self._planned((described, tuple(decls.values()), topology, strategy),
                                 lambda: plan_sequence(parsed, decls, topology, strategy))

        return parsed, stored, make

    def plan_compute_many(self, ops, strategy: str) -> tuple[Program, str]:
        """The program a compute_many job would run now, and its JSON (saved, so the dashboard shows dry runs)."""
        strategy = check_strategy(strategy)
        _, stored, make = self._sequence_planner(ops, strategy)
        program = make(self._compute_inputs(stored), self.registry.topology())
        text = program.dumps()
        self.store.save_plan(program.id, text)
        return program, text

    def compute_many(self, ops, strategy: str) -> Job:
        """Queue one job that runs every op in order as one program and commits every output together; planned
        here first, so a sequence the planner cannot run is refused at once, and the job runs that program unless
        a job before it changes what it was planned from (`Planned`)."""
        strategy = check_strategy(strategy)
        parsed, stored, make = self._sequence_planner(ops, strategy)
        records, topology = self._compute_inputs(stored), self.registry.topology()
        program = make(records, topology)
        outputs = [t for t in program.tensors if t.dst is not None]
        self._check_memory_together([(t.dst, t.shape, t.dtype, f"the output {t.name!r}") for t in outputs],
                                    f"compute_many of {len(parsed)} ops")
        return self.jobs.submit_compute("compute_many", stored, parsed[0].out, strategy, make,
                                        outputs=[op.out for op in parsed],
                                        planned=Planned(program, planned_from(records.values(), topology)))

    def reshard(self, name: str, dst_json: str, strategy: str) -> Job:
        rec = self.catalog.get(name)
        self._check_not_lost(rec)
        dst = self._sharding(dst_json, "destination sharding")
        dst.check_shape(rec.shape)
        self.registry.check_mesh(dst.mesh)
        strategy = check_strategy(strategy)
        check_plan_size(rec.shape, rec.sharding.without_partial(), dst.without_partial(), strategy,
                        self.config.max_plan_tasks, f"resharding {name!r} of shape {rec.shape}")
        planned = None
        if dst.is_partial or rec.sharding.is_partial:
            # Planned here so that a reshard no program can do is refused at once; the job runs this program
            # unless a job queued before it on the tensor changes its sharding (`Planned`).
            topology = self.registry.topology()
            planned = Planned(reshard_program(rec.shape, rec.dtype, rec.sharding, dst, topology, strategy),
                              planned_from([rec], topology))
        self._check_memory(dst, rec.shape, rec.dtype, f"resharding {name!r}")
        return self.jobs.submit(name, dst, strategy, planned)

    def reshard_many(self, targets: list[tuple[str, str]], strategy: str, bucket_bytes: int | None,
                     scales: list[tuple[str, str, tuple[int, ...] | None]], *, manifest_json: str = "",
                     pin: str = "", step: int | None = None, delta: bool | None = None,
                     dtypes: dict[str, str] | None = None) -> Job:
        """Queue one job that reshards every (name, destination sharding JSON) of ``targets`` in one program and
        commits them together: `_many_job` checks the request, `JobRunner.submit_many` queues it.

        A request made again as it was, with no pin or step (a weight sync that calls reshard_many every step), is
        not checked again while nothing its checks read has changed, as a registered sync's run is not
        (`_repeated`): checking a 501-tensor state dict's request was a third of the planner's CPU for its job, and
        the job waited for it. A pin or a step is checked where it is given, every time."""
        received = time.time()
        if pin or step is not None:
            args = self._many_job(targets, strategy, bucket_bytes, scales, manifest_json, pin, step, dtypes)
            return self.jobs.submit_many(**args, pin=pin, step=step, delta=delta, received=received)
        # Its job finds its program as a registered sync's does, by the very objects its last job read (`Job.kept_as`):
        # keyed by every tensor's layout, the look-up of a 501-tensor state dict's took 1 ms of the planner between
        # the request and its first call
        known = self._repeated((list(targets), strategy, bucket_bytes, list(scales), manifest_json,
                                dict(dtypes or {})))
        return self.jobs.submit_many(**known.args, delta=delta, received=received,
                                     repeat=(known.id, known.names, known.slots))

    def _repeated(self, request: tuple) -> RegisteredSync:
        """Reshard_many ``request`` (as `RegisteredSync.request`) checked (`_check_sync`): as remembered from the
        last time it was made, where what its checks read is as it was then (`_checked_now`, and for a request
        that quantizes, its tensors' dtypes), else checked now and remembered by its digest (the last
        `REPEATS_KEPT`; without its targets, which the digest stands for)."""
        key = _request_digest(request)
        with self._syncs_lock:
            known = self._repeats.get(key)
            if known is not None:
                self._repeats.move_to_end(key)
        if known is not None and known.checked == self._checked_now(known.quantizes) and (
                not known.quantizes or self._same_dtypes(known)):
            return known
        checked = self._check_sync(RegisteredSync(key, request, {}, (-1, -1), [], np.zeros(0, np.int64)))
        checked = replace(checked, request=((), *request[1:]))
        with self._syncs_lock:
            self._repeats[key] = checked
            while len(self._repeats) > REPEATS_KEPT:
                self._repeats.popitem(last=False)
        return checked

    def register_sync(self, targets: list[tuple[str, str]], strategy: str, bucket_bytes: int | None,
                      scales: list[tuple[str, str, tuple[int, ...] | None]], *, manifest_json: str = "",
                      dtypes: dict[str, str] | None = None) -> RegisteredSync:
        """Check a reshard_many request once and keep it (`RegisteredSync`): a weight sync then runs it every step
        by its id (`sync`), sending no names or shardings and checking nothing again while the catalog's names,
        shapes and dtypes and the agents' registrations stay as they were (`_checked_now`; a sync that quantizes on
        the way compares its tensors' dtypes, as its weights change dtype twice a step). The planner keeps the last
        `SYNCS_KEPT` registered, in memory only."""
        request = (list(targets), strategy, bucket_bytes, list(scales), manifest_json, dict(dtypes or {}))
        sync = self._check_sync(RegisteredSync(uuid.uuid4().hex, request, {}, (-1, -1), [], np.zeros(0, np.int64)))
        with self._syncs_lock:
            self._syncs[sync.id] = sync
            while len(self._syncs) > SYNCS_KEPT:
                self._syncs.popitem(last=False)
        log.info("sync %s registered: %d tensors", sync.id[:8], len(sync.names))
        return sync

    def sync(self, sync_id: str, *, pin: str = "", step: int | None = None, delta: bool | None = None) -> Job:
        """Queue the reshard_many job of registered sync ``sync_id`` (`register_sync`), moving the versions ``pin``
        or ``step`` names (each must be current; the job checks) or the current ones. Its request is checked
        again, naming what no longer holds, only where a tensor's shape or dtype (of its own, for a sync that
        quantizes: `_same_dtypes`), the names in the catalog or an agent's registration changed since it last was;
        a tensor put in another sharding is planned again by the job, within --max-program-steps."""
        received = time.time()
        with self._syncs_lock:
            sync = self._syncs.get(sync_id)
            if sync is not None:
                self._syncs.move_to_end(sync_id)
        if sync is None:
            raise NotFoundError(f"no registered sync {sync_id[:32]!r}: the planner keeps the last {SYNCS_KEPT} syncs "
                                f"registered, and none across a restart; register it again (register_sync)")
        if sync.checked != self._checked_now(sync.quantizes) or (sync.quantizes and not self._same_dtypes(sync)):
            sync = self._check_sync(sync)
            with self._syncs_lock:
                if sync_id in self._syncs:
                    self._syncs[sync_id] = sync
        return self.jobs.submit_many(**sync.args, pin=pin, step=check_step(step), delta=delta,
                                     sync=(sync.id, sync.names, sync.slots), received=received)

    def _check_sync(self, sync: RegisteredSync) -> RegisteredSync:
        """``sync`` checked now (`_many_job`), with what its checks read (`_checked_now`, and where it quantizes
        the dtypes of the tensors it names), read before them: a change while they run is seen at its next run."""
        targets, strategy, bucket_bytes, scales, manifest_json, dtypes = sync.request
        checked = self._checked_now(sync.quantizes)
        seen = RegisteredSync.seen
        if sync.quantizes:
            held = [n for n in dict.fromkeys([n for n, _ in targets] + [s for _, s, _ in scales])
                    if self.catalog.contains(n)]
            seen = (self.catalog.slots(held), self.catalog.dtype_ids([r.dtype for r in self.catalog.snapshot(held)]))
        args = self._many_job(targets, strategy, bucket_bytes, scales, manifest_json, "", None, dtypes)
        names = sorted(args["dsts"])
        return replace(sync, args=args, checked=checked, names=names, slots=self.catalog.slots(names), seen=seen)

    def _same_dtypes(self, sync: RegisteredSync) -> bool:
        """Whether every tensor ``sync`` saw as it was checked is still in the catalog, in the dtype it had then."""
        return self.catalog.same_dtypes(*sync.seen)

    def _checked_now(self, quantizes: bool) -> tuple[int, int]:
        """What a reshard_many's checks read besides the request and the tensors' source shardings: the catalog's
        names, shapes and dtypes and the agents' registrations, as counters (`Catalog.declared`,
        `Registry.generation`); for a sync that quantizes on the way, `Catalog.shapes` in place of the first (it
        compares its tensors' dtypes itself). A source sharding a sync was not checked with is its job's to find:
        it plans again (`JobRunner._work`)."""
        return self.catalog.shapes if quantizes else self.catalog.declared, self.registry.generation

    def _many_job(self, targets: list[tuple[str, str]], strategy: str, bucket_bytes: int | None,
                  scales: list[tuple[str, str, tuple[int, ...] | None]], manifest_json: str, pin: str,
                  step: int | None, dtypes: dict[str, str] | None) -> dict:
        """Check a reshard_many request; returns the arguments `JobRunner.submit_many` takes but its pin, step
        and delta. The job reshards every (name, destination sharding JSON) of ``targets`` in one program and
        commits them together (`reshard.many`). ``scales`` pairs a weight with its block-scale tensor and block
        (None: from the shapes), which follows the weight's destination (its own may be left empty, or out of
        ``targets``). ``bucket_bytes`` None is the default bucket size, 0 packs nothing. ``manifest_json`` (a
        `reshard.Manifest`'s JSON, or empty) is the consumer's manifest, checked before anything else is
        (`_check_manifest`); the job records its digest. ``pin`` or ``step`` name the versions it moves, which must
        be current. ``dtypes`` (name -> dtype) quantizes those tensors on the way (`reshard.quantize`); a quantized
        weight's scale is made by the job, so it need not be in the catalog. The job's ``delta`` (delta sync):
        None moves each tensor as a delta where a usable base pair is held and its change rate says it pays, False
        moves every tensor whole, True moves a delta wherever a usable base pair is held
        (`JobRunner._choose_deltas`)."""
        if not targets:
            raise InvalidArgumentError("reshard_many needs at least one tensor and its destination; got none")
        names = [n for n, _ in targets]
        repeated = repeated_names(names)
        if repeated:
            raise InvalidArgumentError(f"reshard_many names tensors {repeated[:5]} more than once; give each "
                                       f"tensor one destination")
        strategy = check_strategy(strategy)
        bucket = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        if not 0 <= bucket <= MAX_BUCKET_BYTES:
            raise InvalidArgumentError(f"bucket_bytes {bucket} must be 0 (no buckets) to {MAX_BUCKET_BYTES:,} "
                                       f"({MAX_BUCKET_BYTES // 2**20} MiB), or unset for the default "
                                       f"({DEFAULT_BUCKET_BYTES // 2**20} MiB)")
        pairs = scale_pairs({w: (s, block) for w, s, block in scales})
        if len(pairs) != len(scales):
            raise InvalidArgumentError(f"reshard_many pairs a weight with more than one scale tensor "
                                       f"({[w for w, _, _ in scales][:5]}); give each weight one")
        given = set(names)
        names += [s for s, _ in pairs.values() if s not in given]
        manifest = self._check_manifest(manifest_json, names, f"reshard_many of {len(names)} tensors",
                                        converting={w: (d, *pairs[w]) for w, d in (dtypes or {}).items()
                                                    if w in pairs})
        # A scale the job may make (its weight is asked for in another dtype) need not exist yet.
        made = {pairs[w][0] for w in dtypes or {} if w in pairs}
        absent = made - {n for n in names if self.catalog.contains(n)}
        stored = [n for n in names if n not in absent]
        # With a pin or a step: the versions they name, which must be current (a job moves the current version);
        # a scale the job makes again is read as it is (its publisher never labels it)
        records = dict(zip(stored, self.catalog.current_named(stored, pin, check_step(step), made)))
        for rec in records.values():
            self._check_not_lost(rec)
        converted = conversions([TensorDecl(n, r.shape, r.dtype, r.sharding) for n, r in records.items()], dtypes,
                                pairs) if dtypes else {}
        for name in sorted(absent - {c.scale for c in converted.values()}):
            self.catalog.get(name)  # named as a scale, made by no conversion, and not in the catalog: NOT_FOUND
        followers = {s for s, _ in pairs.values()}
        dsts: dict[str, Sharding] = {}
        parsed: dict[str, Sharding] = {}  # a state dict's tensors share a few layouts: each is read and checked once
        for name, text in targets:
            if not text and name in followers:
                continue  # follows its weight
            rec = records[name]
            dst = parsed.get(text)
            if dst is None:
                dst = parsed[text] = self._sharding(text, f"destination sharding of {name!r}")
                self.registry.check_mesh(dst.mesh)
            dst.check_shape(rec.shape)
            dsts[name] = dst
        decls = [TensorDecl(n, r.shape, r.dtype, r.sharding, dsts.get(n)) for n, r in records.items()]
        decls += [made_scale(c.scale, records[w].shape, c.block, dsts.get(c.scale)) for w, c in converted.items()
                  if c.scale in absent]
        decls = follow_scales(decls, pairs)
        for d in decls:
            if d.dst.is_partial or (d.src is not None and d.src.is_partial):
                raise InvalidArgumentError(
                    f"tensor {d.name!r} goes from {d.src} to {d.dst}, a pending sum on one side; reshard_many moves "
                    f"values, so reshard that tensor on its own (reshard completes or keeps a sum)")
        # What planning costs: each distinct layout is planned once for all its tensors (`plan_many`); the steps
        # the program holds are bounded as it is made (--max-program-steps).
        over = layouts_plan_size(decls).excess(self.config.max_plan_tasks, strategy)
        if over:
            raise ResourceExhaustedError(
                f"reshard_many of {len(decls)} tensors would make too large a "
                f"program: {excess_text(over)} (reshard planner --max-plan-tasks {self.config.max_plan_tasks:,}, "
                f"summed over the distinct layouts); move the tensors in several reshard_many jobs, or raise the "
                f"limit")
        self._check_memory_together([(d.dst, d.shape, converted[d.name].dtype if d.name in converted else d.dtype,
                                      f"resharding {d.name!r}") for d in decls],
                                    f"reshard_many of {len(decls)} tensors")
        return dict(dsts={d.name: d.dst for d in decls}, strategy=strategy, bucket_bytes=bucket,
                    scales={w: [s, list(b) if b else None] for w, (s, b) in pairs.items()},
                    manifest_digest=manifest.digest if manifest is not None else "",
                    dtypes={w: c.dtype for w, c in converted.items()})

    def _check_manifest(self, manifest_json: str, names: list[str], what: str,
                        converting: dict[str, tuple[str, str, object]] | None = None) -> Manifest | None:
        """The consumer's manifest, once every tensor ``names`` moves is in it with the shape and dtype the job
        commits and none it lists is left out; else `ManifestError` (INVALID_ARGUMENT) listing each difference.
        The job commits the catalog's shape and dtype, but for a weight quantized on the way (``converting``:
        weight -> (dtype, its scale, the scale's block)): that dtype, and its scale float32, one entry per block
        (a conversion the planner cannot make is refused after this check, naming it). Checked
        before the catalog is read for the job, so a name the trainer never published is listed with the rest
        rather than failing alone as NOT_FOUND; nothing is planned or moved."""
        if not manifest_json:
            return None
        manifest = Manifest.from_json(manifest_json, max_bytes=self.config.max_json_bytes,
                                      max_depth=self.config.max_json_depth)
        offered, absent = {}, []
        for name in names:
            if self.catalog.contains(name):
                rec = self.catalog.get(name)
                offered[name] = (rec.shape, rec.dtype)
            else:
                offered[name] = None
        for w, (dtype, scale, block) in (converting or {}).items():
            held = offered.get(w)
            try:
                dtype, block = dtype_name(dtype), block_of(w, scale, block)
            except ValueError:
                continue  # refused after this check, naming it
            if held is not None and dtype != held[1]:
                offered[w] = (held[0], dtype)
                offered[scale] = (scale_shape(held[0], block), "float32")
        for name in manifest:
            if name not in offered:
                absent.append((name, "not among the tensors moved"))
            elif offered[name] is None:
                absent.append((name, "not in the catalog"))
        manifest.check({n: e for n, e in offered.items() if e is not None or n not in manifest}, what, absent)
        return manifest

    def _check_memory_together(self, items: list[tuple[Sharding, tuple[int, ...], str, str]], what: str) -> None:
        """`_check_memory` of each (sharding, shape, dtype, what), then of all of them together on every host."""
        per_host: dict[tuple, dict[str, int]] = {}  # (sharding, shape, dtype) -> bytes per host, checked once
        total: dict[str, int] = {}
        for sharding, shape, dtype, one in items:
            key = (sharding, shape, dtype)
            mine = per_host.get(key)
            if mine is None:
                self._check_memory(sharding, shape, dtype, one)
                n = itemsize(dtype_name(dtype))
                mine = per_host[key] = {}
                for dev, tile in sharding.tiles(shape).items():
                    mine[host_of(dev)] = mine.get(host_of(dev), 0) + volume(tile) * n
            for host, nbytes in mine.items():
                total[host] = total.get(host, 0) + nbytes
        for host, nbytes in sorted(total.items()):
            agent = self.registry.get(host)
            limit = agent.memory_limit_bytes if agent is not None else 0
            if limit and nbytes > limit:
                raise ResourceExhaustedError(
                    f"{what} would give host {host}'s devices {format_size(nbytes)} ({nbytes:,} bytes) together, "
                    f"more than its agent's memory limit of {format_size(limit)} ({limit:,} bytes); move fewer "
                    f"tensors at once, shard them over more hosts, or start that agent with a larger --memory-limit")

    @staticmethod
    def _check_not_lost(rec: TensorRecord) -> None:
        """Refuse a reshard of a tensor that lost shards, naming them: DataLossError when some tile has no copy
        left, FailedPreconditionError when every tile still has one. Plans are made from the sharding, which
        counts every replica as a sender and every device as holding its tile, so none can plan around a lost
        replica; get() can (it reads a surviving copy), so the way out is to read the tensor and put it again."""
        if not rec.lost:
            return
        gone = rec.lost_tiles()
        hosts = sorted({host_of(d) for d in rec.lost})
        if gone:
            shown = "; ".join(f"tile {box_str(t)} held by {devs}" for t, devs in list(gone.items())[:8])
            raise DataLossError(
                f"cannot reshard {rec.name!r} v{rec.version}: {len(gone)} of its tiles lost every copy when the agents "
                f"of hosts {hosts} restarted ({shown}{'; ...' if len(gone) > 8 else ''}); delete it and put it again")
        raise FailedPreconditionError(
            f"cannot reshard {rec.name!r} v{rec.version}: devices {sorted(rec.lost)} lost their shards when the "
            f"agents of hosts {hosts} restarted, and a reshard reads from every replica; every tile still has a "
            f"copy, so get() reads it: put it again (under a new name, or after deleting this one)")

    def job(self, job_id: str, wait_s: float = 0.0) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r} (the planner keeps the last {JOBS_KEPT:,} finished jobs)")
        if wait_s > 0:
            job.done_event.wait(min(wait_s, self.config.max_wait_s))
        return job
