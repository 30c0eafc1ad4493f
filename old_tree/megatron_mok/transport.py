"""Peer exchange for the reference backend.

The kernel reads and writes peer ranks' symmetric buffers directly. The reference expresses the
same two moves -- *pull* (an owner reads rows it chose from a source rank) and *push* (a rank
writes rows to positions on their home rank) -- on top of one primitive, a variable-length
all-to-all, so it runs on any torch.distributed backend (gloo on CPU, NCCL on GPU) and on
``EmulatedTransport``: N ranks as N threads of one process, used to check the single-GPU
emulated-EP kernel.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class Transport(ABC):
    """What the MoK reference needs from its expert-parallel group."""

    rank: int
    world_size: int

    @abstractmethod
    def all_to_all(self, send: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``send[d]`` goes to rank d; returns what each rank sent here. Row counts may differ;
        trailing shape and dtype must agree across ranks."""

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.all_to_all([tensor] * self.world_size)

    def all_reduce_max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        return int(max(int(x) for x in self.all_gather(t)))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    # ---- the two MoK moves --------------------------------------------------------------
    def pull(self, source: torch.Tensor, requests: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Read rows ``source_r[requests[r]]`` of every rank r's ``source`` (symmetric: each rank
        passes its own). Returns the rows, per source rank, in request order."""
        wanted = self.all_to_all([r.to(torch.long) for r in requests])
        served = [source.index_select(0, w.to(source.device)) for w in wanted]
        return self.all_to_all(served)

    def push(
        self, rows: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Send ``rows[d]`` to rank d, to land at ``positions[d]`` there. Returns (positions, rows)
        received from every source rank; the caller writes them into its buffer."""
        got_pos = self.all_to_all([p.to(torch.long) for p in positions])
        got_rows = self.all_to_all(list(rows))
        return got_pos, got_rows


class ProcessGroupTransport(Transport):
    """torch.distributed process group (gloo or NCCL)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._backend = dist.get_backend(group)

    @property
    def device(self) -> torch.device:
        if self._backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_to_all(self, send: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(send) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} send tensors, got {len(send)}")
        if self.world_size == 1:
            return [send[0].clone()]
        ref = send[0]
        dev = self.device
        tail = tuple(ref.shape[1:])
        counts = torch.tensor([s.shape[0] for s in send], dtype=torch.long, device=dev)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        in_splits = counts.tolist()
        out_splits = recv_counts.tolist()
        flat_in = torch.cat([s.to(dev).reshape(s.shape[0], *tail) for s in send]).contiguous()
        flat_out = flat_in.new_empty((sum(out_splits), *tail))
        dist.all_to_all_single(flat_out, flat_in, out_splits, in_splits, group=self.group)
        return [t.to(ref.device) for t in torch.split(flat_out, out_splits)]


class _Exchange:
    """Mailboxes shared by the threads of an emulated EP group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.boxes: list[list[Any]] = [[None] * world_size for _ in range(world_size)]


class EmulatedTransport(Transport):
    """One thread per rank in a single process; tensors stay on their device (one GPU holds all)."""

    def __init__(self, rank: int, exchange: _Exchange) -> None:
        self.rank = rank
        self.world_size = exchange.world_size
        self._ex = exchange

    def all_to_all(self, send: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(send) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} send tensors, got {len(send)}")
        for d, t in enumerate(send):
            self._ex.boxes[self.rank][d] = t
        self._ex.barrier.wait()
        got = [self._ex.boxes[s][self.rank].clone() for s in range(self.world_size)]
        self._ex.barrier.wait()  # nobody overwrites a box before everyone has read it
        return got


def run_emulated(world_size: int, fn: Callable[[Transport], T], timeout_s: float = 600.0) -> list[T]:
    """Run ``fn(transport)`` for ranks 0..world_size-1 as threads; results in rank order.

    An exception on any rank aborts the group (the barrier breaks, so no thread hangs) and is
    re-raised here with the rank that raised it.
    """
    exchange = _Exchange(world_size)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(EmulatedTransport(rank, exchange))
        except threading.BrokenBarrierError:
            pass  # another rank failed first; its error is reported
        except BaseException as exc:  # noqa: BLE001 - reported below with the rank
            errors.append((rank, exc))
            exchange.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"mok-ep-rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        if t.is_alive():
            exchange.barrier.abort()
            raise TimeoutError(f"emulated EP rank thread {t.name} did not finish in {timeout_s}s")
    if errors:
        rank, exc = sorted(errors, key=lambda e: e[0])[0]
        raise RuntimeError(f"emulated EP rank {rank} failed: {exc}") from exc
    return results
