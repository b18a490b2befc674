"""What `collsync.torch.ops`'s collectives share: Horovod's op and compression constants, its exceptions, the
argument checks and the agreement check of the metadata of a collective; with the MPI datatypes and operations
(`_mpi_types`) and the handles `*_async` returns (`_handles`), which it re-exports.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from collsync.torch import _stall
from collsync.torch._compression import Compression as Compression
from collsync.torch._compression import FP16Compressor as FP16Compressor
from collsync.torch._compression import NoneCompressor as NoneCompressor
from collsync.torch._handles import _Handle as _Handle
from collsync.torch._handles import _handle as _handle
from collsync.torch._handles import _register as _register
from collsync.torch._handles import _Requests as _Requests
from collsync.torch._handles import _unnamed as _unnamed
from collsync.torch._handles import poll as poll
from collsync.torch._handles import synchronize as synchronize
from collsync.torch._handles import tensor_name
from collsync.torch._mpi_types import HALVES as HALVES
from collsync.torch._mpi_types import Adasum as Adasum
from collsync.torch._mpi_types import Average as Average
from collsync.torch._mpi_types import Max as Max
from collsync.torch._mpi_types import Min as Min
from collsync.torch._mpi_types import Product as Product
from collsync.torch._mpi_types import Sum as Sum
from collsync.torch._mpi_types import _mpi_type as _mpi_type
from collsync.torch._mpi_types import _reduce_op as _reduce_op
from collsync.torch._mpi_types import _sum_op as _sum_op
from collsync.torch._mpi_types import scale_ as scale_
from collsync.torch._mpi_types import words as words
from collsync.torch._process_sets import global_process_set, set_comm

_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's `HorovodInternalError`): here, the workers disagreed on a collective's
    dtype, shape or root, or (inside `hvd.elastic.run`, under ULFM) a worker died in the bsp step. `hvd.elastic.run`
    restores the last commit on it and calls the function again, as Horovod's elastic mode does; elsewhere it is an
    error."""


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 - Horovod's name
    """Horovod's elastic-mode interrupt (the set of hosts changed). collsync has no host discovery and never raises
    it; a script may, and `hvd.elastic.run` then resets as Horovod's does."""

    def __init__(self, skip_sync: bool) -> None:
        super().__init__(skip_sync)
        self.skip_sync = skip_sync


def _op(op: int | None, average: bool | None, what: str) -> int:
    """Horovod's reduction: `op` (Average when None) or the deprecated `average=`; Adasum is refused."""
    if average is not None:
        if op is not None:
            raise ValueError(f"{what}: give op= or the deprecated average=, not both")
        return Average if average else Sum
    op = Average if op is None else op
    if op == Adasum:
        raise NotImplementedError(f"{what}: op=Adasum is not supported by collsync (Average, Sum, Min, Max, Product)")
    if op not in _OP_NAMES:
        raise ValueError(f"{what}: op={op!r} must be collsync.torch.Average, Sum, Min, Max or Product")
    return op


def _process_set(process_set: Any, what: str) -> None:
    """Refuse a process set other than the global one, where an operation does not take one."""
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(f"{what}: process sets are not supported here (process_set={process_set!r})")


def _agree(comm: Any, meta: tuple[Any, ...], what: str, vary: tuple[int, ...] = ()) -> list[tuple[Any, ...]]:
    """Every worker's `meta` (dtype, shape, root...) of one collective, gathered in rank order; HorovodInternalError
    on every worker if they differ in a field not listed in `vary` (Horovod's coordinator checks the same before it
    runs a collective; a mismatch reaching MPI would hang or corrupt memory)."""
    metas: list[tuple[Any, ...]] = comm.allgather(meta)
    for field in range(len(meta)):
        values = [m[field] for m in metas]
        if field not in vary and any(v != values[0] for v in values):
            raise HorovodInternalError(f"{what}: the workers disagree: {values} (by rank)")
    return metas


# Fixed codes for the dtypes in an agreement header (the hash of a dtype's name differs between processes).
_DTYPE_CODES: dict[torch.dtype, int] = {
    dt: i
    for i, dt in enumerate(
        (torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
        + (torch.float16, torch.bfloat16, torch.bool, torch.complex64, torch.complex128)
    )
}
_FIELD = (1 << 62) - 1  # header fields are kept below 2**62, so that their negation fits an int64


def _bits(value: float) -> int:
    """A float's 64 bits as a header field (a scale factor must agree exactly, as Horovod checks it)."""
    bits: int = struct.unpack("<Q", struct.pack("<d", value))[0]
    return (bits & _FIELD) ^ (bits >> 62)  # the two top bits (sign, exponent) folded into the low ones


# What an agreement header says an operation is (Horovod's request types, for the ones a joined worker follows).
ALLREDUCE, ALLGATHER, BROADCAST, REDUCESCATTER, ALLTOALL = 1, 2, 3, 4, 5
_LOW = -(1 << 62)  # a joined worker's header fields: below any real one, so the maximum is the others'
# The header's first fields are combined by their maximum only: whether some worker is still active, whether some
# worker has joined, the rank that joins in this round, whether the operation blocks. The others are checked for
# agreement (their maximum and minimum must be equal), the minimum coming back as the maximum of the negations.
_ACTIVE, _JOINED, _LAST, _BLOCKING, _CHECKED = 0, 1, 2, 3, 4
_SIGNATURE = 9  # the checked fields: kind, tensors, dtypes, shapes, op, prescale, postscale, root, name
_NO_HEADER = np.zeros(0, dtype=np.int64)  # a named operation's header: none (it is never posted)


def _name_code(name: str | None) -> int:
    """A name as a header field (CRC-32: the same in every process, unlike `hash` of a str); 0 for an unnamed op."""
    return 0 if name is None else 1 + zlib.crc32(name.encode())


class _Agreement:
    """The check that every worker calls a collective with the same tensors: Horovod's coordinator refuses an
    allreduce whose type, shape, op or scale factors differ between ranks ("Mismatched allreduce tensor shapes",
    "Mismatched data types"), where MPI would return each rank its own shape, wrong values, or abort the job. The
    name is checked too: named operations called in another order on another worker are refused, not combined.

    One small MPI_Iallreduce (MAX) per operation (a grouped operation is one) on a communicator of its own beside
    the data's (`_headers`), so headers are matched in the order the operations are called whatever order their
    data moves in. Only where the fields differ do the workers gather the readable descriptions, all of them (each
    sees the same maximum), and raise HorovodInternalError naming which workers sent what. The header also carries
    Horovod's join: a worker in `join()` answers every header (`join`), contributing zeros to allreduces, and an
    allgather or broadcast while some worker has joined is refused on the others, as Horovod refuses it."""

    def __init__(
        self,
        comm: Any,
        tensors: Sequence[torch.Tensor],
        op: int,
        pre: float,
        post: float,
        what: str,
        kind: int = ALLREDUCE,
        root: int = -1,
        blocking: bool = False,
        name: str | None = None,
    ) -> None:
        self.comm, self.what, self.op, self.pre, self.post, self.kind = comm, what, op, pre, post, kind
        self.root, self.name = root, name
        # What a named operation meets the others' by: Horovod's tensor name, the kind of call and the name.
        self.key = None if name is None else tensor_name(what, name)
        self.dtypes = tuple(t.dtype for t in tensors)
        self.shapes = tuple(tuple(t.shape) for t in tensors)
        codes = tuple(_DTYPE_CODES.get(d, -1) for d in self.dtypes)
        sig = [kind, len(tensors), hash(codes) & _FIELD, hash(self.shapes) & _FIELD, op, _bits(pre), _bits(post), root]
        sig.append(_name_code(name))  # named operations called in another order on another worker are told apart
        # A named operation's description travels in its negotiation round (`_names`), never in a header.
        header = [1, 0, _LOW, int(blocking), *sig, *(-v for v in sig)]
        self.buf = _NO_HEADER if name is not None else np.array(header, dtype=np.int64)
        self.hcomm = _headers(comm)
        self.side = _HEADERS[id(comm)][2]
        # Its number on `comm`, which the stall check asks for (named operations are the negotiator's: `_names`).
        self.seq = _stall.header_number(self.side, what) if name is None else 0
        self.since = time.monotonic()
        self.request: Any = None
        self.error: HorovodInternalError | None = None

    def fields(self) -> tuple[tuple[str, Any], ...]:
        """The header's fields as an error names them (built only where the workers disagree)."""
        return fields(self.what, self.dtypes, self.shapes, self.op, self.pre, self.post, self.root, self.name)

    def start(self) -> _Agreement:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        self.request = self.hcomm.Iallreduce(MPI.IN_PLACE, self.buf, op=MPI.MAX)
        self.since = time.monotonic()
        return self

    def now(self) -> None:
        """Agree before returning (a blocking operation; the header itself is always nonblocking, so that every
        worker's headers match whichever call each made)."""
        self.start()
        _spin(self.request, self)
        self.verify()

    def verify(self) -> None:
        """Raise HorovodInternalError on every worker if any field differed between them, or if this operation
        cannot run while a worker has joined. Called in the order the data starts (`_flush`): what it gathers
        travels on the data's communicator, in step on every worker."""
        buf = self.buf
        if buf[_JOINED]:
            if buf[_CHECKED] != ALLREDUCE:
                raise HorovodInternalError(
                    f"{self.what}: not supported while a worker has joined (Horovod: not supported with Join at "
                    "this time)"
                )
            if _disagree(buf):
                raise HorovodInternalError(
                    f"{self.what}: mismatched tensor types, shapes, op or scale factors across the workers still "
                    "active (some worker has joined)"
                )
            self.comm.allgather((self.dtypes, self.shapes, self.op))  # what the joined workers contribute zeros to
            return
        if _disagree(buf):
            raise explain(self.what, list(enumerate(self.comm.allgather(self.fields()))))


def fields(
    what: str, dtypes: Any, shapes: Any, op: int, pre: float, post: float, root: int, name: str | None
) -> tuple[tuple[str, Any], ...]:
    """An operation's checked fields as an error names them."""
    types = tuple(str(d).replace("torch.", "") for d in dtypes)
    one = len(dtypes) == 1  # a single tensor's type and shape are shown as such, not as a group's
    return (
        ("operation", what),
        ("number of tensors", len(dtypes)),
        ("type" if one else "types", types[0] if one else types),
        ("shape" if one else "shapes", list(shapes[0]) if one else [list(s) for s in shapes]),
        ("op", _OP_NAMES.get(op, op)),
        ("prescale factor", pre),
        ("postscale factor", post),
        ("root rank", root),
        ("name", name),
    )


def explain(what: str, sent: list[tuple[int, Any]]) -> HorovodInternalError:
    """The error every worker raises where the workers' fields of one operation differ: `sent` is each worker's
    rank and fields (`_Agreement.fields`), the same on every worker; the first field that differs is named with the
    workers that sent each value."""
    for i, (field, _) in enumerate(sent[0][1]):
        by_value: dict[str, list[int]] = {}
        for rank, fields in sent:
            by_value.setdefault(repr(fields[i][1]), []).append(rank)
        if len(by_value) > 1:
            said = "; ".join(f"{_ranks(ranks)} sent {value}" for value, ranks in by_value.items())
            return HorovodInternalError(f"{what}: mismatched tensor {field} across the workers: {said}")
    return HorovodInternalError(f"{what}: the workers' headers differ, their tensors do not: {sent}")


def _disagree(buf: np.ndarray) -> bool:
    """Whether the checked fields of a combined header differ between the workers (maximum != minimum)."""
    n = (len(buf) - _CHECKED) // 2
    return not bool((buf[_CHECKED : _CHECKED + n] == -buf[_CHECKED + n :]).all())


def _spin(request: Any, header: _Agreement | None = None) -> None:
    """Wait for an MPI request, yielding the core between tests (see `_Handle.wait`); a wait for a `header` is
    watched by the stall check (`_stall`), and every wait answers the other workers' stall questions."""
    while not request.Test():
        if header is None:
            _stall.STALL.tick()
        else:
            _stall.STALL.tick(header.side, header.seq, header.what, header.since)
        os.sched_yield()


def _ranks(ranks: list[int]) -> str:
    """'rank 1' or 'ranks 0, 2' (worker ranks, within the process set)."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# Per data communicator: its headers' communicator (a duplicate, made at its first header), the stall check's, the
# barrier's, the named operations' rounds and data (`_names`), and the operations whose header is posted and whose
# data is not yet: their data starts in the order they were called, on every worker.
_HEADERS: dict[int, tuple[Any, Any, _stall.Side, Any, Any, Any]] = {}
_PENDING: dict[int, deque[_AfterAgreement]] = {}


def _headers(comm: Any) -> Any:
    """The communicator `comm`'s agreement headers travel on (`MPI_Comm_dup`, collective: every worker makes it at
    the same call, its first header, named operation, `join` or `barrier`), made with the stall check's
    (`_stall.Side`), the barrier's (`barrier_comm`) and the named operations' two (`_names.Negotiator`). The entry
    holds `comm` itself, so its id stays its own."""
    entry = _HEADERS.get(id(comm))
    if entry is None or entry[0] is not comm:
        _stall.STALL.tick()  # the Dups wait for every worker: the hooks run as on any wait (PSP's `ServerMode._away`)
        entry = _HEADERS[id(comm)] = (
            comm,
            comm.Dup(),
            _stall.STALL.side(comm.Dup()),
            comm.Dup(),
            comm.Dup(),
            comm.Dup(),
        )
    return entry[1]


def dups(comm: Any) -> list[Any]:
    """The duplicates of `comm` the operations wait on (headers, stall check, barrier): revoked with it (ULFM)."""
    entry = _HEADERS.get(id(comm))
    return [] if entry is None or entry[0] is not comm else [entry[1], entry[2].comm, entry[3]]


def forget(comm: Any) -> None:
    """Drop what was made for `comm`, a communicator shrunk away after a rank died (ULFM): the stall check would
    probe its side at every later wait, and fail there on the dead rank."""
    entry, _ = _HEADERS.pop(id(comm), None), _PENDING.pop(id(comm), None)
    if entry is not None:
        _stall.STALL.sides = [side for side in _stall.STALL.sides if side is not entry[2]]


def barrier_comm(comm: Any) -> Any:
    """The communicator `barrier()` on `comm` runs on: a duplicate of its own, so that a barrier is ordered neither
    with the data nor with the headers of the operations in flight. A worker may call `barrier()` while an
    operation it started waits for the others, who start that operation only after the barrier (Horovod's
    coordinator matches operations by name, so there the barrier does not wait for it either)."""
    _headers(comm)
    return _HEADERS[id(comm)][3]


def _flush(comm: Any) -> None:
    """Start the data of the operations on `comm` whose headers are posted, oldest first, waiting for their headers:
    MPI matches collectives on a communicator by their order, so every worker starts them in the order the
    operations were called, whatever order it polls or synchronizes them in. An operation whose header shows a
    disagreement keeps the error for its `synchronize` and moves no data (on every worker alike)."""
    queue = _PENDING.get(id(comm))
    while queue:
        queue.popleft().begin()


def progress(comm: Any) -> None:
    """Start the data of the oldest operations on `comm` whose headers have arrived, without waiting: a worker in
    `join()` moves each operation's data before it answers the next header, so a later header completes only once
    the earlier data has started."""
    queue = _PENDING.get(id(comm))
    while queue and queue[0].agreement.request.Test():
        queue.popleft().begin()


def _comm(process_set: Any, what: str) -> tuple[Any, list[int] | None]:
    """`set_comm`, after starting the data of operations still waiting for it on that communicator (`_flush`):
    every operation that posts on a communicator takes it through here."""
    comm, ranks = set_comm(process_set, what)
    _flush(comm)
    return comm, ranks


class _AfterAgreement:
    """A request (for `_Handle`) that waits for an agreement, then starts the operation itself (`start()` returns
    its request): the data moves only once every worker is known to send the same shape and type, and in the order
    the operations were called (`_flush`)."""

    def __init__(self, agreement: _Agreement, start: Callable[[Any], Any]) -> None:
        self.agreement, self.start, self.request, self.begun = agreement, start, None, False
        agreement.start()
        _PENDING.setdefault(id(agreement.comm), deque()).append(self)

    def begin(self) -> None:
        """Wait for the header, check it, start the data (or keep the error)."""
        if self.begun:
            return
        self.begun = True
        _spin(self.agreement.request, self.agreement)
        try:
            self.agreement.verify()
        except HorovodInternalError as exc:
            self.agreement.error = exc
            return
        self.request = self.start(self.agreement.comm)

    def header(self) -> _Agreement | None:
        """The agreement this operation still waits for (None once its data started): what a wait on it is, for
        the stall check (`_Handle.wait`)."""
        return None if self.begun else self.agreement

    def Test(self) -> bool:  # noqa: N802 - MPI.Request's name, which _Handle calls
        if not self.begun:
            progress(self.agreement.comm)
            if not self.begun:
                return False
        if self.agreement.error is not None:
            raise self.agreement.error
        return self.request is None or bool(self.request.Test())


def _check(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise NotImplementedError(f"{what}: collsync moves CPU tensors; got one on {tensor.device}")
    if tensor.is_sparse:
        raise NotImplementedError(f"{what}: sparse tensors are not supported (densify them first)")
