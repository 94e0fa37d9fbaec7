"""Running one model over several ranks: the communicator and the split of a packed sequence.

A rank group (started by cluster/ or by a test) runs the same job on every rank, in lockstep: every rank
builds the same graph, draws the same noise and samples the same steps. What differs is the work inside
the models, which share it through a `Communicator` (one torch.distributed process group: NCCL on CUDA,
gloo on CPU):

- the H3 transformer splits its packed rows: `SequenceSplit` pads the rows to a multiple of the rank count
  and gives each rank one contiguous slice; every per-row operation runs on the slice, and attention
  trades heads for rows with one all-to-all (each rank attends over every row with heads/N heads, then
  trades back), so the math is one device's. N must divide the head count.
- the video VAE decodes its temporal windows round-robin over the ranks and gathers the pixels.
- what does not split (the text encoder, the audio VAE) runs on rank 0 and is broadcast.

Every collective has the process group's timeout: a rank that dies or hangs makes the others raise
instead of waiting for ever. Outside a group (`communicator()` is None) models run as on one device.
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 300.0    # how long a collective waits for a missing rank before the job fails


class RankFailure(RuntimeError):
    """A collective failed: another rank of the group died, hung past the timeout or refused the call."""


def divisors(count: int) -> list[int]:
    """The rank counts that split `count` heads evenly."""
    return [n for n in range(1, count + 1) if count % n == 0]


class Communicator:
    """The ranks one model runs over: a torch.distributed process group, this process's rank and the group size.

    Counts the bytes it sends (`bytes_sent`), which the benchmark reports per step.
    """

    def __init__(self, group: Any = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("a Communicator needs torch.distributed initialised (init_process_group) first")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout_s = float(timeout_s)
        self.bytes_sent = 0
        # NCCL moves device tensors only; gloo host tensors (it can move device ones too, through the host).
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if dist.get_backend(group) == "nccl" else torch.device("cpu"))

    @classmethod
    def start(cls, *, rank: int, size: int, address: str, backend: str | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> "Communicator":
        """Join (or form) the group at `address` ("tcp://host:port") as `rank` of `size`; gloo on CPU, NCCL with CUDA."""
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(timeout_s=timeout_s)

    def close(self) -> None:
        """Leave the group (the process group is destroyed)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def is_root(self) -> bool:
        """Whether this is rank 0, the rank that speaks for the group."""
        return self.rank == 0

    def check_heads(self, heads: int, what: str = "the H3 transformer") -> None:
        """ValueError unless the group size divides `heads`, naming the sizes that do."""
        if heads % self.size:
            raise ValueError(f"{what} has {heads} attention heads, which {self.size} ranks cannot share evenly; "
                             f"use a rank count that divides {heads}: {', '.join(map(str, divisors(heads)))}")

    def _collective(self, what: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except RuntimeError as err:
            raise RankFailure(f"rank {self.rank} of {self.size}: {what} failed, so another rank of the group has "
                              f"died, hung for more than {self.timeout_s:g} s or failed itself ({err})") from err

    # Collectives -------------------------------------------------------------------------------

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (N, ...): block i goes to rank i, block j of the result came from rank j."""
        recv = torch.empty_like(send)
        self._collective("an all-to-all", lambda: dist.all_to_all_single(recv, send, group=self.group))
        self.bytes_sent += send.numel() * send.element_size() * (self.size - 1) // self.size
        return recv

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """(rows, ...) on every rank -> (N * rows, ...), rank 0's rows first."""
        local = local.contiguous()
        out = local.new_empty((self.size * local.shape[0], *local.shape[1:]))
        self._collective("an all-gather", lambda: dist.all_gather_single(out, local, group=self.group))
        self.bytes_sent += local.numel() * local.element_size()
        return out

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of every rank's `tensor`, on every rank (in place when the devices allow)."""
        moved = tensor.to(self.device)
        self._collective("an all-reduce", lambda: dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=self.group))
        self.bytes_sent += moved.numel() * moved.element_size()
        if moved is not tensor:
            tensor.copy_(moved)
        return tensor

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (pickled between the group's own processes, never from outside)."""
        box = [value if self.is_root else None]
        self._collective("a broadcast", lambda: dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def on_root(self, compute: Callable[[], T]) -> T:
        """`compute()` run on rank 0 only, its result (or its error) broadcast to every rank."""
        outcome: tuple[bool, Any] = (True, None)
        if self.is_root:
            try:
                outcome = (True, compute())
            except Exception as err:  # every rank must raise, not only the root
                outcome = (False, err)
        ok, value = self.broadcast_object(outcome)
        if not ok:
            raise value
        return value

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        self._collective("a barrier", lambda: dist.barrier(group=self.group))


@dataclass(frozen=True)
class SequenceSplit:
    """How `rows` rows are shared: padded to `padded` (a multiple of the rank count), rank r holding
    rows [r * per_rank, (r + 1) * per_rank). Padding rows sit at the end and never reach an output."""

    comm: Communicator
    rows: int

    @property
    def per_rank(self) -> int:
        """Rows each rank holds, padding included."""
        return math.ceil(self.rows / self.comm.size)

    @property
    def padded(self) -> int:
        """Rows including padding."""
        return self.per_rank * self.comm.size

    @property
    def span(self) -> tuple[int, int]:
        """The rows of the sequence this rank holds, padding excluded: [start, stop)."""
        start = self.comm.rank * self.per_rank
        return min(start, self.rows), min(start + self.per_rank, self.rows)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """(rows, ...) -> this rank's (per_rank, ...) slice, zero rows standing for padding."""
        start, stop = self.span
        if stop - start == self.per_rank:
            return full[start:stop]
        out = full.new_zeros((self.per_rank, *full.shape[1:]))
        out[:stop - start] = full[start:stop]
        return out

    def overlap(self, start: int, stop: int) -> tuple[slice, slice] | None:
        """Where the sequence rows [start, stop) lie in this rank's slice and in the run itself, or None."""
        lo, hi = max(start, self.span[0]), min(stop, self.span[1])
        if lo >= hi:
            return None
        return slice(lo - self.span[0], hi - self.span[0]), slice(lo - start, hi - start)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's (per_rank, ...) slice -> the (rows, ...) sequence on every rank."""
        return self.comm.all_gather(local)[:self.rows]

    def heads_to_rows(self, *parts: torch.Tensor) -> list[torch.Tensor]:
        """(per_rank, heads, dim) tensors -> (rows, heads / N, dim): every row, this rank's share of the heads.

        One all-to-all for all parts; rank r gets heads [r * heads / N, (r + 1) * heads / N).
        """
        n = self.comm.size
        stacked = torch.stack(parts, dim=1)                              # (per_rank, parts, heads, dim)
        rows, count, heads, dim = stacked.shape
        send = stacked.view(rows, count, n, heads // n, dim).permute(2, 0, 1, 3, 4).contiguous()
        recv = self.comm.all_to_all(send)                                # (N, per_rank, parts, heads / N, dim)
        full = recv.view(n * rows, count, heads // n, dim)[:self.rows]
        return list(full.unbind(1))

    def rows_to_heads(self, full: torch.Tensor) -> torch.Tensor:
        """Inverse of heads_to_rows for one tensor: (rows, heads / N, dim) -> (per_rank, heads * dim)."""
        n = self.comm.size
        rows, heads_here, dim = full.shape
        send = full.new_zeros((self.padded, heads_here, dim))
        send[:rows] = full
        recv = self.comm.all_to_all(send.view(n, self.per_rank, heads_here, dim))  # block j: heads of rank j
        return recv.permute(1, 0, 2, 3).reshape(self.per_rank, n * heads_here * dim)


def join_group(*, rank: int, size: int, address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Communicator:
    """Make this process rank `rank` of the group meeting at `address`, on its own GPU when there are GPUs
    (rank r on GPU r modulo the GPUs it sees: a Ray actor sees only its own), and configure models with it."""
    if size > 1 and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = Communicator.start(rank=rank, size=size, address=address, timeout_s=timeout_s)
    configure(comm)
    return comm


# The configured runtime: the communicator of this process's rank group, if it belongs to one.
_communicator: Communicator | None = None
# The split of the sequence whose transformer blocks are running (None: attention sees every row).
_split: contextvars.ContextVar[SequenceSplit | None] = contextvars.ContextVar("weft_sequence_split", default=None)
# Set while rank 0 runs something alone for the group (nothing inside it may wait for the other ranks).
_on_root: contextvars.ContextVar[bool] = contextvars.ContextVar("weft_on_root", default=False)


def configure(comm: Communicator | None) -> None:
    """Make `comm` the communicator models of this process use (None: run on one device)."""
    global _communicator
    _communicator = comm


def communicator() -> Communicator | None:
    """The communicator of this process's rank group, or None when it runs alone (or in a group of one)."""
    return _communicator if _communicator is not None and _communicator.size > 1 else None


@contextlib.contextmanager
def sequence_split(split: SequenceSplit | None) -> Iterator[None]:
    """Attention inside the block exchanges heads over `split` (None: nothing is split)."""
    token = _split.set(split)
    try:
        yield
    finally:
        _split.reset(token)


def on_root_in_group(method: Callable[..., T]) -> Callable[..., T]:
    """Decorates what a rank group does not split: run on rank 0 only, its result broadcast to every rank.

    Outside a group the method runs as it is; a call made from inside another such call runs where it is.
    """
    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        comm = communicator()
        if comm is None or _on_root.get():
            return method(*args, **kwargs)

        def run() -> T:
            token = _on_root.set(True)
            try:
                return method(*args, **kwargs)
            finally:
                _on_root.reset(token)
        return comm.on_root(run)
    return wrapped


def active_split() -> SequenceSplit | None:
    """The split of the sequence whose blocks are running, or None."""
    return _split.get()
