"""Named operations met by name across the workers, as Horovod's coordinator meets them, and `join` without an
optimizer, which answers them.

Horovod queues each operation under its name and runs it the moment every rank has submitted that name, so
workers may start named operations in different orders. collsync has no coordinator thread: the workers negotiate
in rounds, one small MPI_Iallgather each (`Negotiator`) on a communicator of their own (`_ops_base._headers`),
posted by a worker while it has a named operation not yet started (or has joined) and moved on by every wait of
every collective (`_stall.STALL.tick`), as Horovod's background thread would. A name is Horovod's tensor name, the
kind of call and the name (`_handles.tensor_name`: `allreduce.x` and `allgather.x` are two names). A round carries
each worker's names (a 62-bit hash) with what their agreement header checks, written out (`describe`: kind,
dtypes, shapes, op, scale factors, root, the name's CRC-32), and an allgather's first dimensions or an alltoall's
first dimension and splits. A name that every active worker lists is
ready; the ready names start in the order the lowest active worker lists them, the same on every worker (MPI
matches collectives by order), on a data communicator of their own, ordered neither with the unnamed operations'
data nor with their headers. Settling a round never waits for another worker (a worker settles it inside any
wait, where another may be inside a blocking collective), so everything it needs travels in the round: a ready
name whose descriptions differ raises HorovodInternalError on every worker naming what each sent; while some
worker has joined, a ready allreduce gets the joined workers' zeros (of the described types and shapes), and any
other operation is refused, as in Horovod.

Unnamed operations keep their headers in calling order: Horovod names them `<op>.noname.<n>`, n counting the
calling process's operations, which pairs them by calling order too.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from collsync.torch import _stall
from collsync.torch._ops_base import (
    _ACTIVE,
    _BLOCKING,
    _CHECKED,
    _DTYPE_CODES,
    _FIELD,
    _HEADERS,
    _JOINED,
    _LAST,
    _LOW,
    _SIGNATURE,
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    HorovodInternalError,
    _AfterAgreement,
    _Agreement,
    _disagree,
    _flush,
    _headers,
    _mpi_type,
    _name_code,
    _reduce_op,
    _Requests,
    _spin,
    explain,
    fields,
    words,
)
from collsync.torch._ops_base import forget as _forget
from collsync.torch._ops_base import progress as _progress

_MIN_WIDTH = 256  # a round's int64s per worker; it grows (in step: from the last round) while names wait beyond it
_HEAD = 3  # a round's first fields: whether the worker has joined, how many names it lists, the width it needs
_REFUSED = "not supported while a worker has joined (Horovod: not supported with Join at this time)"
_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def name_key(name: str) -> int:
    """A name as a round field: 62 bits of its BLAKE2 hash (the same in every process; 0 marks no name). Two names
    that collide still differ in their description's CRC-32 of the name, which refuses rather than combines them."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return 1 + (int.from_bytes(digest, "little") & (_FIELD >> 1))


def _float(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def describe(agreement: _Agreement) -> tuple[int, ...]:
    """What the workers must agree on, written out as int64s: kind, number of tensors, each one's dtype code and
    shape, op, the scale factors' bits, root, and the CRC-32 of its `key` (an allgather's or alltoall's first
    dimensions are 0 here: they may differ, and travel as its rows)."""
    out = [agreement.kind, len(agreement.dtypes)]
    for dtype, shape in zip(agreement.dtypes, agreement.shapes, strict=True):
        out += [_DTYPE_CODES.get(dtype, -1), len(shape), *shape]
    out += [agreement.op, _float(agreement.pre), _float(agreement.post), agreement.root]
    return (*out, _name_code(agreement.key))


def _read(desc: tuple[int, ...]) -> tuple[int, list[torch.dtype], list[tuple[int, ...]], int, float, float, int]:
    """`describe`'s fields back: kind, dtypes, shapes, op, prescale, postscale, root."""
    kind, count, at = desc[0], desc[1], 2
    dtypes, shapes = [], []
    for _ in range(count):
        dtypes.append(_DTYPES.get(desc[at], torch.float32))
        shapes.append(tuple(desc[at + 2 : at + 2 + desc[at + 1]]))
        at += 2 + desc[at + 1]
    pre, post = (struct.unpack("<d", struct.pack("<q", v))[0] for v in desc[at + 1 : at + 3])
    return kind, dtypes, shapes, desc[at], pre, post, desc[at + 3]


class Named:
    """A named operation for `_Handle`: started by its communicator's `Negotiator` once every worker has called
    it, then tested as its data's request. It meets the others' operation of its `key` (the kind of call and the
    name, as Horovod keys it). `rows`: an allgather's first dimensions, or an alltoall's first dimension and
    splits, which its start takes from the round instead of gathering them."""

    def __init__(self, agreement: _Agreement, start: Callable[..., Any], rows: tuple[int, ...] | None) -> None:
        assert agreement.key is not None
        self.agreement, self.start, self.rows = agreement, start, rows
        self.key = name_key(agreement.key)
        self.entry = (self.key, *_packed(describe(agreement)), *_packed(rows or ()))
        self.request: Any = None
        self.begun, self.warned, self.since = False, False, time.monotonic()
        self.negotiator = negotiator(agreement.comm)
        self.negotiator.submit(self)

    def begin(self, comm: Any, rows: list[tuple[int, ...]]) -> None:
        self.begun = True
        self.request = self.start(comm) if self.rows is None else self.start(comm, rows)

    def fail(self, error: HorovodInternalError) -> None:
        self.begun, self.agreement.error = True, error

    def header(self) -> None:
        """No header to wait for: a named operation's stall check is its negotiator's (`Negotiator.stalled`)."""
        return None

    def Test(self) -> bool:  # noqa: N802 - MPI.Request's name, which _Handle calls
        if not self.begun:
            self.negotiator.progress()
            if not self.begun:
                self.negotiator.stalled(self)
                return False
        if self.agreement.error is not None:
            raise self.agreement.error
        return self.request is None or bool(self.request.Test())


def _packed(values: tuple[int, ...]) -> tuple[int, ...]:
    return (len(values), *values)


class Negotiator:
    """One communicator's named operations: those not yet started (`waiting`, in calling order) and the round in
    flight (at most one: a worker's i-th round meets every other worker's i-th, all of `width` int64s)."""

    def __init__(self, comm: Any) -> None:
        _headers(comm)
        entry = _HEADERS[id(comm)]
        self.comm, self.rounds, self.data = comm, entry[4], entry[5]
        self.size, self.width = comm.Get_size(), _MIN_WIDTH
        self.waiting: dict[int, Named] = {}
        self.request: Any = None
        self.bufs = (np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))
        self.joined = self.all_joined = self.busy = False
        self.holding = False  # submitted names wait for the next round of their own (`in_one_round`)
        self.joined_posts = 0  # the rounds this worker posted since it joined
        self.side = entry[2]
        self.side.named = lambda: [str(op.agreement.key) for op in self.waiting.values()]
        self.zeros: list[tuple[Any, list[torch.Tensor]]] = []  # a joined worker's contributions still moving

    def submit(self, op: Named) -> None:
        self.waiting[op.key] = op
        if not self.holding:
            self.progress()

    def progress(self) -> None:
        """Settle the round in flight if it has arrived, and post the next while this worker has names waiting or
        has joined (until a round shows every worker joined). Never waits for another worker."""
        if self.busy:
            return
        self.busy = True
        try:
            self.zeros = [z for z in self.zeros if not z[0].Test()]
            if self.request is not None and self.request.Test():
                self.request = None
                self._settle(self.bufs[1].reshape(self.size, self.width))
            if self.request is None and (self.waiting or (self.joined and not self.all_joined)):
                self._post()
        finally:
            self.busy = False

    def _post(self) -> None:
        send = np.zeros(self.width, dtype=np.int64)
        entries = [op.entry for op in self.waiting.values()]
        listed, at = 0, _HEAD
        for entry in entries:
            if at + len(entry) > self.width:
                break
            send[at : at + len(entry)] = entry
            listed, at = listed + 1, at + len(entry)
        send[0], send[1], send[2] = int(self.joined), listed, _HEAD + sum(len(e) for e in entries)
        self.joined_posts += int(self.joined)
        self.bufs = (send, np.zeros(self.size * self.width, dtype=np.int64))
        self.request = self.rounds.Iallgather(send, self.bufs[1])

    def _settle(self, table: np.ndarray) -> None:
        """Start (or refuse) the names every active worker listed, in the lowest active worker's order; the next
        round's width is what the widest worker needs (the same on every worker)."""
        need = int(table[:, 2].max())
        self.width = max(_MIN_WIDTH, 1 << (need - 1).bit_length())
        joined = [bool(row[0]) for row in table]
        if all(joined):
            self.all_joined = True
            return
        lists = [_entries(row) for row in table]
        found = [dict(entries) for entries in lists]
        active = [r for r in range(self.size) if not joined[r]]
        for key, _ in lists[active[0]]:
            if all(key in found[r] for r in active):
                self._run(self.waiting.pop(key, None), [(r, *found[r][key]) for r in active], any(joined))

    def _run(self, op: Named | None, sent: list[tuple[int, tuple[int, ...], tuple[int, ...]]], joined: bool) -> None:
        """One ready name, on every worker alike (`op` is None on a joined worker): each active worker's rank,
        description and rows in `sent`."""
        if any(desc != sent[0][1] for _, desc, _ in sent):
            if op is not None:
                what, name = op.agreement.what, op.agreement.name
                said = [(rank, fields(what, *_shown(desc, rows), name)) for rank, desc, rows in sent]
                op.fail(explain(what, said))
            return
        kind, dtypes, shapes, how = _read(sent[0][1])[:4]
        if joined and kind != ALLREDUCE:
            if op is not None:
                op.fail(HorovodInternalError(f"{op.agreement.what}: {_REFUSED}"))
            return
        if op is not None:
            op.begin(self.data, [rows for _, _, rows in sent])
        elif (moving := _zeros(self.data, dtypes, shapes, how, blocking=False)) is not None:
            self.zeros.append(moving)

    def stalled(self, op: Named) -> None:
        """Horovod's stall check for a named operation not started (`_stall`): past the warning time one line
        naming the workers that have not called it, past the end time the job ends."""
        _stall.STALL.tick(self.side, 0, op.agreement.what, op.since, op.agreement.key)


def _shown(desc: tuple[int, ...], rows: tuple[int, ...]) -> tuple[Any, Any, int, float, float, int]:
    """`_read`'s fields after the kind, as a worker called the operation: an allgather's or alltoall's shapes with
    its own first dimensions (its rows: an allgather's first dimensions, an alltoall's first dimension before its
    splits)."""
    kind, dtypes, shapes, op, pre, post, root = _read(desc)
    if kind == ALLGATHER and len(rows) == len(shapes):
        shapes = [(first, *shape[1:]) for first, shape in zip(rows, shapes, strict=True)]
    elif kind == ALLTOALL and rows:
        shapes = [(rows[0], *shapes[0][1:])]
    return dtypes, shapes, op, pre, post, root


def _entries(row: np.ndarray) -> list[tuple[int, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """A round's row back as (name, (description, rows)) in the worker's calling order."""
    out, at = [], _HEAD
    values: list[int] = row.tolist()  # Python ints at once: reading numpy scalars one by one costs more than the round
    for _ in range(values[1]):
        key, length = values[at], values[at + 1]
        desc = tuple(values[at + 2 : at + 2 + length])
        at += 2 + length
        count = values[at]
        rows = tuple(values[at + 1 : at + 1 + count])
        at += 1 + count
        out.append((key, (desc, rows)))
    return out


_NEGOTIATORS: dict[int, Negotiator] = {}
_stall.STALL.hooks.append(lambda: progress_all())


def negotiator(comm: Any) -> Negotiator:
    """`comm`'s negotiator, made at its first named operation or `join` (with `_headers`)."""
    made = _NEGOTIATORS.get(id(comm))
    if made is None or made.comm is not comm:
        made = _NEGOTIATORS[id(comm)] = Negotiator(comm)
    return made


@contextmanager
def in_one_round(comm: Any) -> Iterator[None]:
    """Named operations started inside go out together in the next round (as many as its width holds), not the
    first of them alone in a round of its own (each start posts a round when none is in flight):
    `broadcast_parameters` starts one per tensor, whose data would otherwise wait for a second round. Nothing
    inside may wait for another worker: this worker posts no round until the block ends."""
    made = negotiator(comm)
    made.holding = True
    try:
        yield
    finally:
        made.holding = False
        made.progress()


def after(
    agreement: _Agreement, start: Callable[..., Any], rows: tuple[int, ...] | None = None
) -> Named | _AfterAgreement:
    """The request of an operation that waits for its agreement: by name where it has one, else in calling order
    (`rows`: an allgather's first dimensions, for a named one's start)."""
    return _AfterAgreement(agreement, start) if agreement.name is None else Named(agreement, start, rows)


def progress_all() -> None:
    """Every communicator's named rounds moved on: called from every wait of every collective (`_stall` ticks), as
    Horovod's background thread negotiates whatever the script waits for."""
    for made in list(_NEGOTIATORS.values()):
        made.progress()


def progress(comm: Any) -> None:
    """Move `comm`'s operations on without waiting: unnamed ones whose headers arrived, and the named rounds."""
    _progress(comm)
    made = _NEGOTIATORS.get(id(comm))
    if made is not None and made.comm is comm:
        made.progress()


def forget(comm: Any) -> None:
    """Drop what was made for `comm` (`_ops_base.forget`), its negotiator included."""
    _forget(comm)
    _NEGOTIATORS.pop(id(comm), None)


def _zeros(comm: Any, dtypes: Any, shapes: Any, op: int, blocking: bool) -> tuple[Any, list[torch.Tensor]] | None:
    """A joined worker's part of an allreduce: zeros of the others' types and shapes on `comm`, blocking or not
    (as the others move theirs). Returns the requests with the zeros they read, kept until they complete."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    requests, held = [], []
    for dtype, shape in zip(dtypes, shapes, strict=True):
        zeros = torch.zeros(shape, dtype=dtype)
        message = [words(zeros), _mpi_type(dtype, "join")]
        held.append(zeros)
        if blocking:
            comm.Allreduce(MPI.IN_PLACE, message, op=_reduce_op(dtype, op))
        else:
            requests.append(comm.Iallreduce(MPI.IN_PLACE, message, op=_reduce_op(dtype, op)))
    return (_Requests(requests), held) if requests else None


def join_collectives(comm: Any) -> int:
    """Horovod's `join()` without an optimizer: this worker has no more data. Until every worker has joined it
    answers every agreement header of the others and every round of their named operations: an allreduce gets
    zeros of the others' types and shapes (so an Average is the sum over the active workers divided by all of
    them, as in Horovod), an allgather or broadcast is refused on the others (`_Agreement.verify`, `Negotiator`).
    Returns the rank that joined last (the highest of those that joined in the last round), the same on every
    worker. Collectives without a header (alltoall, barrier, the object operations) are not answered: the others
    would wait for this worker."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    _flush(comm)
    hcomm = _headers(comm)
    named = negotiator(comm)
    named.joined, named.all_joined, named.joined_posts = True, False, 0
    width = _CHECKED + 2 * _SIGNATURE
    last, rounds = comm.Get_rank(), 0
    while True:
        buf = np.full(width, _LOW, dtype=np.int64)
        buf[_ACTIVE], buf[_JOINED], buf[_LAST] = 0, 1, last
        last, rounds = _LOW, rounds + 1  # this worker's rank goes with its first round only
        _wait(hcomm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.MAX), named)
        if buf[_ACTIVE] == 0:
            break
        if buf[_CHECKED] != ALLREDUCE or _disagree(buf):
            continue  # refused on the active workers: no data moves
        dtypes, shapes, op = next(e for e in comm.allgather(None) if e is not None)
        moving = _zeros(comm, dtypes, shapes, op, blocking=bool(buf[_BLOCKING]))
        if moving is not None:
            _spin(moving[0])
    while not named.all_joined:  # the named rounds end too: every worker posts its last one
        _wait(None, named)
    named.joined = False
    # The workers that joined last joined in the last round of both streams (headers and named rounds): the
    # highest of them, agreed on by every worker (all are here); else the headers' answer alone.
    latest = comm.Get_rank() if rounds == 1 and named.joined_posts == 1 else -1
    agreed = int(hcomm.allreduce(latest, op=MPI.MAX))
    return agreed if agreed >= 0 else int(buf[_LAST])


def _wait(request: Any, named: Negotiator) -> None:
    """Wait for `request` (or, with None, one step) while answering the named rounds and the stall questions."""
    while request is None or not request.Test():
        named.progress()
        _stall.STALL.tick()
        os.sched_yield()
        if request is None:
            return
