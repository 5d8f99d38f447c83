"""Data-parallel private training on torch.distributed: one replica of the model per process (rank).

    torchrun --nproc_per_node=2 -m runner.cli method=reweight dataset=digits     # gloo on CPU, nccl on CUDA
    world = init(device, timeout_s=300, seed=0)    # from torchrun's / Slurm's / submitit's environment, or 1 process
    idx = world.share(global_idx)                  # this rank's contiguous share of the step's global Poisson batch
    world.all_reduce_(grads)                       # the clipped sums added over ranks, flattened into few buckets

Semantics (docs/distributed.md). Every rank draws the SAME global Poisson mask from the run's seed (one sampler,
identically seeded) and keeps its contiguous share, so the union of the shares is exactly the one-process batch:
one Poisson sample of the whole training set with rate q = B/N, one mechanism for the accountant, whatever the
number of ranks; a run on N ranks can be checked against a run on one, and resumed on another world size.
Each rank computes its share's clipped gradient sum (in chunks of physical_batch_size); the sums are added across
ranks (all_reduce_, not one call per parameter); every rank then adds the SAME Gaussian draw (torch's global RNG,
in step on every rank: it is seeded alike and only the mechanism draws from it, see forward_rng) and divides by
the expected global batch size: the noise is added once to the global sum, and the replicas stay identical, which
check_replicas verifies every epoch. A rank with an empty share still joins every collective.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runner.errors import DprunError
from runner.launcher_env import launched_rank, launched_world_size  # noqa: F401  (the launcher's environment)

log = logging.getLogger("dprun")

BUCKET_BYTES = 64 * 2**20  # all_reduce_ sends gradients in flat buckets of at most this size (one copy of each)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[03-05,7],cpu1' -> 'gpu03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise DprunError(f"cannot read the first host of SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    return prefix if not ranges else prefix + ranges.split(",")[0].split("-")[0]


def export_slurm_env() -> None:
    """torch.distributed's env:// variables from the Slurm (srun) or submitit environment, where torchrun has not
    set them. submitit's own TorchDistributedEnvironment where it applies (launcher=slurm|submitit_local); a plain
    `srun python -m runner.cli ...` maps SLURM_PROCID/NTASKS/LOCALID and the node list's first host itself."""
    if os.environ.get("WORLD_SIZE"):
        return  # torchrun (or the user) already did
    if os.environ.get("SUBMITIT_EXECUTOR"):
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        return
    if os.environ.get("SLURM_PROCID") is None:
        return
    job = int(os.environ.get("SLURM_JOB_ID", "0"))
    os.environ.update({
        "RANK": os.environ["SLURM_PROCID"], "WORLD_SIZE": os.environ["SLURM_NTASKS"],
        "LOCAL_RANK": os.environ.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR") or first_host(os.environ.get("SLURM_JOB_NODELIST", "localhost")),
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(20000 + job % 40000),
    })


def local_rendezvous() -> dict:
    """init_process_group's rendezvous for launcher=submitit_local: a file in the job's submitit folder, where all
    its tasks run on this machine. No TCP port: the one submitit derives from the job id may be taken (by another
    job's gloo sockets, say), and then rank 0 fails to bind while the others wait the whole timeout for it.
    Elsewhere ({} here) env://, from torchrun's, srun's or submitit's variables."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "local":
        return {}
    from submitit import JobEnvironment

    env = JobEnvironment()
    env.paths.folder.mkdir(parents=True, exist_ok=True)
    store = env.paths.folder / f"dprun_rendezvous_{env.job_id}"  # FileStore removes it when the last rank leaves
    return {"init_method": store.resolve().as_uri(), "rank": env.global_rank, "world_size": env.num_tasks}


@dataclass
class World:
    """The ranks of one run. World() is one process (every method a no-op), as without torch.distributed."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None
    seed: int = 0  # the run's seed: each rank's forward randomness (dropout) is derived from it, the step and the rank
    steps: int = 0  # logical steps taken (forward_rng's stream index; restored on resume)
    owned: bool = False  # True: init() started the process group, so shutdown() ends it (never a user's own)
    bytes_reduced: int = 0  # gradient bytes all_reduce_ has summed so far (runner/bench/distributed.py)

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes the run's files."""
        return self.rank == 0

    def share(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of the global batch's indices (B_t,) -> (~B_t / size,); may be empty."""
        return idx if self.size == 1 else idx.tensor_split(self.size)[self.rank]

    def all_reduce_(self, tensors: list[torch.Tensor]) -> int:
        """Sum each tensor over the ranks, in place: flattened into buckets of BUCKET_BYTES per (device, dtype),
        one all_reduce per bucket. Returns the bytes reduced (the benchmark's column)."""
        if self.size == 1 or not tensors:
            return 0
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        sent = 0
        for group in groups.values():
            for bucket in _buckets(group, BUCKET_BYTES):
                flat = torch.cat([t.reshape(-1) for t in bucket])  # (sum of the bucket's numels,)
                dist.all_reduce(flat)
                for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                    t.copy_(part.view_as(t))
                sent += flat.numel() * flat.element_size()
        self.bytes_reduced += sent
        return sent

    def same_everywhere(self, value: int, device: torch.device) -> bool:
        """Does every rank hold this integer? One small all_reduce of (v, v^2) in float64 (v below 2^25, exact): the
        sums are (n v, n v^2) on a rank only if every rank's v is its v (Cauchy-Schwarz), so all ranks agree on the
        answer. The API's check that a release adds every rank's share of ONE Poisson batch (review 46)."""
        if self.size == 1:
            return True
        v = float(int(value) % 2**25)
        t = torch.tensor([v, v * v], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist() == [self.size * v, self.size * v * v]

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Metrics added over ranks (loss sums, correct counts, examples seen): one small all_reduce."""
        return self._reduce(values, device, dist.ReduceOp.SUM)

    def max(self, values: list[float], device: torch.device) -> list[float]:
        """The largest over ranks (the slowest rank's step time, the largest peak memory)."""
        return self._reduce(values, device, dist.ReduceOp.MAX)

    def _reduce(self, values, device, op) -> list[float]:
        if self.size == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def forward_rng(self, device: torch.device):
        """The forward's randomness (dropout) on several ranks: a fork of torch's RNG seeded from (seed, step,
        rank), so that what each rank's share draws leaves the global stream (the mechanism's: JL directions,
        noise) in step on every rank. One process: no fork (the stream is as it always was)."""
        self.steps += 1
        if self.size == 1:
            return contextlib.nullcontext()
        return _seeded_fork(device, self.seed, self.steps, self.rank)

    def check_replicas(self, model: torch.nn.Module, device: torch.device, when: str) -> None:
        """Every rank holds the same parameters: a float64 checksum per rank, gathered; DprunError if any differs."""
        if self.size == 1:
            return
        with torch.no_grad():
            params = [p.detach() for p in model.parameters()]
            weights = torch.arange(1, len(params) + 1, dtype=torch.float64, device=device)
            sums = torch.stack([p.double().sum() for p in params]) if params else weights[:0]
            mine = torch.stack([(sums * weights).sum(), (sums.abs()).sum()])  # (2,)
            every = [torch.zeros_like(mine) for _ in range(self.size)]
            dist.all_gather(every, mine)
        differ = [r for r, c in enumerate(every) if not torch.equal(c, every[0])]
        if differ:
            raise DprunError(f"replicas diverged {when}: rank {differ[0]}'s parameter checksum "
                             f"{every[differ[0]].tolist()} != rank 0's {every[0].tolist()}; the step is not identical "
                             f"on every rank (a rank-dependent random draw or a non-deterministic kernel)")

    def report_failure(self, message: str) -> None:
        """Tell the other ranks why this one stops, through the process group's store (best effort: a rank killed
        by SIGKILL reports nothing): rank 0's summary.json then names the rank that failed and its error."""
        if self.size == 1:
            return
        try:
            dist.distributed_c10d._get_default_store().set(f"dprun/failed/{self.rank}", message)
        except Exception:  # noqa: BLE001  the store may be gone with the job: nothing more to do
            pass

    def peer_failure(self, wait_s: float = 1.0) -> str | None:
        """'rank r: <its error>' of another rank that reported one (waiting up to wait_s for it), else None."""
        if self.size == 1:
            return None
        import time

        deadline = time.monotonic() + wait_s
        while True:
            for r in range(self.size):
                key = f"dprun/failed/{r}"
                try:
                    if r != self.rank and dist.distributed_c10d._get_default_store().check([key]):
                        return f"rank {r}: {dist.distributed_c10d._get_default_store().get(key).decode()}"
                except Exception:  # noqa: BLE001  the store went away: no report to read
                    return None
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def broken_collective(e: BaseException) -> bool:
    """An error raised because ANOTHER rank is gone (a collective whose peer closed, or timed out)."""
    text = str(e).lower()
    return isinstance(e, getattr(dist, "DistError", ())) or any(
        k in text for k in ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout",
                            "pair closure", "broken pipe"))  # gloo: "Application timeout caused pair closure"


def _buckets(tensors: list[torch.Tensor], limit: int):
    """Consecutive groups of tensors of at most `limit` bytes each (a larger tensor alone)."""
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def _seeded_fork(device: torch.device, seed: int, step: int, rank: int):
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    digest = hashlib.blake2b(f"{seed}/{step}/{rank}".encode(), digest_size=8).digest()

    @contextlib.contextmanager
    def fork():
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
            yield
    return fork()


def current(seed: int = 0) -> World:
    """The World of a default process group someone already initialised (the library API inside a user's own
    torch.distributed program); one process otherwise."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                     dist.get_backend(), seed)
    return World(seed=seed)


def init(device_name: str, timeout_s: float, seed: int, backend: str = "auto") -> World:
    """The run's World: one process unless a launcher started several (torchrun, srun, submitit), in which case the
    default process group is initialised here (env://) with `timeout_s` on every collective, so that no rank waits
    forever for a rank that died. A process group the user initialised (library API) is used as it is."""
    if (dist.is_available() and dist.is_initialized()) or launched_world_size() <= 1:
        return current(seed)
    if not dist.is_available():
        raise DprunError("this torch build has no torch.distributed; run one process")
    export_slurm_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    chosen = backend if backend != "auto" else ("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(local_rank)
    rendezvous = local_rendezvous()
    dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=float(timeout_s)), **rendezvous)
    world = World(dist.get_rank(), dist.get_world_size(), local_rank, chosen, seed, owned=True)
    log.info("distributed: rank %d of %d (backend %s, local rank %d, rendezvous %s)", world.rank, world.size, chosen,
             local_rank, rendezvous.get("init_method", "env://"))
    return world


def shutdown(world: World, wait: bool = False) -> None:
    """Leave the process group (only one dprun started); wait: the run ended normally on every rank (leave)."""
    if world.owned and dist.is_initialized():
        leave(wait)


def leave(wait: bool = True) -> None:
    """Destroy the process group, after a barrier when `wait` (every rank finished normally: a failed rank must
    not wait for peers that may be gone). A rank that tore its gloo group down while another still finished its last
    collective aborted in the interpreter's exit ("terminate called without an active exception", SIGABRT after
    every result was written: 2-rank CPU tests under load, stop 38)."""
    if wait and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()
