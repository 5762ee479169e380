"""Several processes: pipeline stages on the GPUs of a host, data-parallel replicas across hosts.

Knows: the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); how ranks form
pipelines (consecutive ranks, `stages` of them per replica; torchrun numbers a host's ranks
consecutively, so a replica of LOCAL_WORLD_SIZE stages is one host) and the process groups each
needs; this rank's device and its share of the host's CPU memory and disk; which prompts a
replica answers (a hash of the id); the name of a data-parallel replica's shard file (merged into
the output by flexoff.jobs); starting torchrun itself
for `flexoff run --pipeline-parallel N`.
Does not know: the engine's schedule (offload.pipeline), generation, prompt formats.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from flexoff.errors import InputError
from flexoff.offload.pipeline import PipeLink

TIMEOUT = timedelta(days=7)  # a stage may wait for another's weights to load, a replica for the slowest
SHARD = ".replica-"  # a replica's results: OUTPUT.replica-R-of-N


def in_torchrun() -> bool:
    """Whether this process is a worker that torchrun started."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass
class World:
    """This process's place: its pipeline stage and its replica."""

    rank: int
    size: int
    local_rank: int
    local_size: int  # processes on this host (they share its CPU memory and disk)
    stages: int  # pipeline stages per replica
    link: PipeLink | None  # this rank's connections within its pipeline (None: one stage)
    everyone: Any = None  # a gloo group of every rank (barriers)

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    @property
    def replicas(self) -> int:
        return self.size // self.stages

    @property
    def leader(self) -> bool:
        """The replica's first stage: it reads the job's state and writes the replica's results."""
        return self.stage == 0

    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    def share(self, host_bytes: int | None) -> int | None:
        """This rank's share of a host-wide budget (CPU memory, disk)."""
        return None if host_bytes is None else host_bytes // self.local_size

    def owns(self, request_id: str) -> bool:
        """Whether this rank's replica answers the request (each id is answered by one replica)."""
        return zlib.crc32(request_id.encode()) % self.replicas == self.replica

    def broadcast(self, value: Any) -> Any:
        """The leader's value at every stage of the replica."""
        if self.link is None:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, self.link.ranks[0], group=self.link.control)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.everyone)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def init(stages: int | None) -> World:
    """Join the torchrun job: `stages` per pipeline (default: every process of a host)."""
    import torch.distributed as dist

    env = os.environ
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank, local_size = int(env["LOCAL_RANK"]), int(env.get("LOCAL_WORLD_SIZE", size))
    stages = stages or local_size
    if stages < 1 or size % stages:
        raise InputError(f"--pipeline-parallel {stages} must divide the {size} processes torchrun started")
    cuda = torch.cuda.is_available()
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise InputError(f"process {local_rank} of this host has no GPU ({torch.cuda.device_count()} visible)")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=TIMEOUT)
    link = None
    for r in range(size // stages):  # every rank makes every group, in the same order
        ranks = tuple(range(r * stages, (r + 1) * stages))
        groups = [dist.new_group(list(ranks), timeout=TIMEOUT) for _ in range(2)]
        control = dist.new_group(list(ranks), timeout=TIMEOUT, backend="gloo")
        if rank in ranks and stages > 1:
            link = PipeLink(rank - ranks[0], stages, ranks, groups[0], groups[1], control)
    everyone = dist.new_group(list(range(size)), timeout=TIMEOUT, backend="gloo")
    return World(rank, size, local_rank, local_size, stages, link, everyone)


# ---- data-parallel results ------------------------------------------------------------------
def shard_path(output: str, world: World) -> str:
    return f"{output}{SHARD}{world.replica}-of-{world.replicas}"


# ---- launching ------------------------------------------------------------------------------
def launch(stages: int, argv: list[str]) -> int:
    """`flexoff run --pipeline-parallel N`: start N workers on this host through torchrun's own
    launcher, each running the same command. Returns the first failed worker's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // stages)))  # cores per worker
    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={stages}", "--max-restarts=0",
                                         "--module", "flexoff", *argv])
    try:
        run(args)
        return 0
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c and c > 0), 1)

