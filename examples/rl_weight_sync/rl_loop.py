"""An RL loop's weight sync: 4 FSDP2 trainer ranks publish every AdamW step; a 2-rank tensor-parallel serving job
keeps generating from its live copy of the model while the next step lands and is read into a standby copy, then
swaps the two (serving's only pause).

    python examples/rl_weight_sync/rl_loop.py                 # starts a local cluster (4 hosts x 2 devices)
    python examples/rl_weight_sync/rl_loop.py --planner ADDR  # or uses yours (hosts host0..host3)

The model is a transformers LlamaForCausalLM made from a small config (random init, fixed seed: nothing is
downloaded). The trainer and the serving job are separate torch.distributed worlds (gloo, CPU) that meet only in
reshard's catalog and a key-value store for "published"/"moved"/"synced" signals. Serving rank 0 prints, per step,
the trainer's publish, the sync (seconds and network bytes), the read into the standby copy, how many generations
the live copy ran meanwhile, and the swap's seconds: the time serving paused.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

TRAIN_HOSTS, SERVE_HOSTS = ["host0", "host1"], ["host2", "host3"]
WAIT = datetime.timedelta(seconds=300)


def llama(args, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                        intermediate_size=args.hidden * 3 // 2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=128))


def train(args, rank: int, kv) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import reshard

    c = reshard.connect(args.planner)
    ids = torch.randint(0, args.vocab, (2, 32), generator=torch.Generator().manual_seed(rank))
    # -- README begins: trainer
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    model = llama(args, seed=0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    devices = c.mesh_devices(mesh, TRAIN_HOSTS)  # rank -> "host/index", as torchrun places ranks
    for step in range(1, args.steps + 1):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step > 1:
            kv.wait([f"synced/{step - 1}"], WAIT)  # one step off-policy: the servers took the last one
        start = time.perf_counter()
        c.put_state_dict(model, devices, step=step)  # one transaction over every rank: returns once it is visible
    # -- README ends
        if rank == 0:
            kv.set(f"published/{step}", f"{time.perf_counter() - start:.6f}")
    c.close()


def serve(args, rank: int, kv) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    import reshard

    c = reshard.connect(args.planner)
    prompt = torch.tensor([[1, 5, 9, 2, 7, 3]])
    config, _, meshes = LlamaForCausalLM.prepare_distribute_model(DistributedConfig(tp_size=2), device_map=None)
    jobs, pool = [], ThreadPoolExecutor(1, thread_name_prefix="refresh")
    # -- README begins: serving
    models = DoubleBuffer(*(LlamaForCausalLM.maybe_distribute_model(llama(args, seed=1), config, meshes).eval()
                            for _ in range(2)))  # two copies: the live one generates, the standby takes the next step
    devices = c.mesh_devices(meshes.get_mesh("tp"), SERVE_HOSTS)
    manifest = reshard.Manifest.from_module(models.live)  # every weight the model loads: nothing missing or extra
    for step in range(1, args.steps + 1):
        def refresh():  # every rank, in the background; rank 0 first moves the step into the standby's layout
            if rank == 0:
                kv.wait([f"published/{step}"], WAIT)
                jobs.append(c.sync_state_dict(models.standby, devices, version=step, manifest=manifest))
                kv.set(f"moved/{step}", "1")
            kv.wait([f"moved/{step}"], WAIT)
            models.fill(c.get_state_dict, devices, version=step)  # this rank's shards, into the standby in place
        refreshing = pool.submit(refresh)
        generated = keep_serving(models, prompt, refreshing)  # the live copy, until every rank's standby is full
        pause_s = models.swap()  # serving's only pause: a reference assignment under a lock
    # -- README ends
        if rank == 0:
            job, publish_s = jobs[-1], float(kv.get(f"published/{step}"))
            print(f"step {step}: publish {publish_s:.3f} s, sync {job.seconds:.3f} s "
                  f"({job.network_bytes:,} bytes over the network, {job.transport}), read into the standby "
                  f"{models.fill_s:.3f} s, {generated} generations during the sync and the read, serving paused "
                  f"{pause_s:.6f} s (the swap)", flush=True)
            if args.report:  # for bench/weight_sync.py --rl-loop: the step's numbers, and the layouts
                row = {"step": step, "publish_s": publish_s, "sync_s": job.seconds, "read_s": models.fill_s,
                       "pause_s": pause_s, "network_bytes": job.network_bytes, "generated": generated,
                       "transport": job.transport,
                       "layouts": {n: s.to_json() for n, s in c.state_dict_shardings(models.live, devices).items()}}
                with open(args.report, "a") as f:
                    f.write(json.dumps(row) + "\n")
        dist.barrier()
        if rank == 0:
            kv.set(f"synced/{step}", "1")
    tokens = models.live.generate(prompt, max_new_tokens=8, do_sample=False)[0].tolist()  # every tensor-parallel rank
    if rank == 0:
        print(f"tokens from step {args.steps}'s weights: {tokens}", flush=True)
    pool.shutdown()
    c.close()


class DoubleBuffer:
    """Two copies of the serving model: ``live`` generates, ``standby`` is filled with the next version (`fill`),
    and `swap` exchanges them, a reference assignment under a lock: all the pause serving sees. The price is a
    second copy of the weights in memory."""

    def __init__(self, live, standby):
        self._lock = threading.Lock()
        self._live, self.standby = live, standby
        self.fill_s = 0.0  # how long the last fill took

    @property
    def live(self):
        with self._lock:
            return self._live

    def fill(self, read, *args, **kwargs) -> None:
        """``read(standby, *args, **kwargs)``, timed: it writes the next version into the standby copy in place."""
        start = time.perf_counter()
        read(self.standby, *args, **kwargs)
        self.fill_s = time.perf_counter() - start

    def swap(self) -> float:
        """Make the standby copy live and the live one the standby; returns the seconds it took."""
        start = time.perf_counter()
        with self._lock:
            self._live, self.standby = self.standby, self._live
        return time.perf_counter() - start


def keep_serving(models: DoubleBuffer, prompt, refreshing) -> int:
    """Generate from the live copy until every rank's ``refreshing`` (a future) is done, then raise its error if it
    failed; returns how many generations ran. The ranks agree after every generation (an all-reduce of "done"), so
    they stop after the same one and swap together: tensor-parallel ranks must serve one version."""
    import torch
    import torch.distributed as dist

    generated = 0
    while True:
        with torch.no_grad():
            models.live.generate(prompt, max_new_tokens=4, do_sample=False)
        generated += 1
        done = torch.tensor([int(refreshing.done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            refreshing.result()
            return generated


def rank_main(args) -> None:
    import torch.distributed as dist

    world = 4 if args.role == "train" else 2
    os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(world), LOCAL_RANK=str(args.rank))
    dist.init_process_group("gloo", store=dist.FileStore(args.store, world), rank=args.rank, world_size=world,
                            timeout=WAIT)
    kv = dist.TCPStore("127.0.0.1", args.kv_port, is_master=False, timeout=WAIT)
    (train if args.role == "train" else serve)(args, args.rank, kv)
    dist.destroy_process_group()


def launch(args) -> int:
    """Start the trainer's 4 ranks and the server's 2 against the planner, and wait for them."""
    import tempfile

    import torch.distributed as dist

    kv = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=WAIT)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    sizes = ["--steps", str(args.steps), "--hidden", str(args.hidden), "--layers", str(args.layers),
             "--vocab", str(args.vocab), "--planner", args.planner, "--report", args.report]
    with tempfile.TemporaryDirectory(prefix="rl-weight-sync-") as tmp:
        procs = [subprocess.Popen([sys.executable, __file__, *sizes, "--role", role, "--rank", str(r),
                                   "--store", os.path.join(tmp, role), "--kv-port", str(kv.port)], env=env)
                 for role, world in (("train", 4), ("serve", 2)) for r in range(world)]
        codes = [p.wait() for p in procs]
    return max(codes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--planner", default="", help="the planner's address (default: start a local cluster)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--report", default="", help=argparse.SUPPRESS)  # bench/weight_sync.py: a JSON line a step
    parser.add_argument("--role", choices=["train", "serve"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--kv-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        rank_main(args)
        return 0
    if args.planner:
        return launch(args)
    import reshard

    with reshard.local_cluster(hosts=4, devices_per_host=2, transport="grpc") as c:
        os.environ["RESHARD_TOKEN"] = c.cluster.token
        args.planner = c.address
        return launch(args)


if __name__ == "__main__":
    sys.exit(main())
