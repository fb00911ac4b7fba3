"""The ranks a KV-parallel session is sharded over: a `torch.distributed` process group (gloo
on CPU, nccl on CUDA) and the few collectives KV parallelism needs, each with a timeout, so a
rank that fails is reported as an error on the others instead of a hang."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from streamgrok.errors import StreamgrokError

T = TypeVar("T")


class KVParallelError(StreamgrokError):
    """A collective among the KV-parallel ranks failed (a rank exited, hung or timed out)."""


@dataclass
class KVGroup:
    """This process's place among the KV-parallel ranks. A world of 1 needs no process group
    (every collective returns its input), so one code path serves both."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = "none"
    timeout_s: float = 60.0
    commands: Any = None  # the process group rank 0's commands travel on (no timeout)

    @classmethod
    def from_env(cls, timeout_s: float = 60.0, backend: str | None = None) -> KVGroup:
        """Join the ranks `torchrun` (or the caller) describes in RANK, WORLD_SIZE,
        MASTER_ADDR and MASTER_PORT; a single process when WORLD_SIZE is unset or 1."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda \
            else torch.device("cpu")
        if world == 1:
            return cls(0, 1, device, "none", timeout_s)
        backend = backend or ("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(device)  # "cuda" (the model's device) means this rank's GPU
        if not dist.is_initialized():
            try:
                dist.init_process_group(backend, rank=rank, world_size=world,
                                        timeout=timedelta(seconds=timeout_s))
            except (RuntimeError, ValueError) as exc:
                raise KVParallelError(
                    f"rank {rank} of {world} could not join the KV-parallel group "
                    f"({backend} at {os.environ.get('MASTER_ADDR')}:"
                    f"{os.environ.get('MASTER_PORT')}): {exc}"
                ) from exc
        # rank 0 may be idle for hours between commands; a rank that exits still shows at
        # once, as a closed connection
        commands = dist.new_group(backend="gloo", timeout=timedelta(days=365))
        return cls(rank, world, device, backend, timeout_s, commands)

    def send_command(self, command: object) -> None:
        """Rank 0: send `command` to every other rank, in order (nothing for one rank)."""
        if self.world > 1:
            self._run("command broadcast", lambda: dist.broadcast_object_list(
                [command], src=0, group=self.commands))

    def receive_command(self) -> object:
        """Ranks > 0: the next command rank 0 sent (waits as long as it takes)."""
        box: list[object] = [None]
        self._run("command receive", lambda: dist.broadcast_object_list(
            box, src=0, group=self.commands))
        return box[0]

    def close(self) -> None:
        """Leave the process group (nothing to do for a single process)."""
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (all the same shape and dtype), in rank order."""
        if self.world == 1:
            return [tensor]
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        self._run("all_gather", lambda: dist.all_gather(parts, tensor))
        return parts

    def all_gather_rows(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` [n_rank, ...] with its own row count, in rank order."""
        if self.world == 1:
            return [tensor]
        count = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        counts = [int(c) for c in self.all_gather(count)]
        padded = tensor.new_zeros((max(counts), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        return [part[:n] for part, n in zip(self.all_gather(padded), counts)]

    def all_to_all_rows(self, tensor: torch.Tensor, send_counts: list[int]
                        ) -> tuple[torch.Tensor, list[int]]:
        """Send `tensor`'s rows [sum(send_counts), ...] in consecutive runs, `send_counts[r]`
        rows to rank r; returns the rows received (rank order) and how many came from
        each rank."""
        if self.world == 1:
            return tensor, list(send_counts)
        sent = torch.tensor(send_counts, dtype=torch.int64)
        received = torch.empty_like(sent)
        self._run("all_to_all counts", lambda: dist.all_to_all_single(received, sent))
        recv_counts = [int(c) for c in received]
        tensor = tensor.contiguous()
        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        self._run("all_to_all", lambda: dist.all_to_all_single(
            out, tensor, output_split_sizes=recv_counts, input_split_sizes=list(send_counts)))
        return out, recv_counts

    def failed_ranks(self, ok: bool) -> list[int]:
        """The ranks whose `ok` is False (every rank calls this with its own)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self.device)
        return [rank for rank, value in enumerate(self.all_gather(flag)) if int(value) == 0]

    def _run(self, name: str, collective: Callable[[], T]) -> T:
        try:
            return collective()
        except (RuntimeError, dist.DistError) as exc:
            raise KVParallelError(
                f"KV-parallel {name} failed on rank {self.rank} of {self.world} "
                f"(another rank exited or did not answer within {self.timeout_s:g} s): {exc}"
            ) from exc
