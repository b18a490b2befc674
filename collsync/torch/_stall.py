"""Horovod's stall check for `collsync.torch`'s collectives: a collective some workers called and others did not is
named after `HOROVOD_STALL_CHECK_TIME_SECONDS` (60 s, Horovod's variable and default; `HOROVOD_STALL_CHECK_DISABLE=1`
turns the warning off), with the workers that did not call it, and past `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS` (where
set above 0) or else the world's deadline (`init(deadline=...)`, the sync mode's, 600 s by default) the job ends
naming them, instead of every worker waiting for ever.

Horovod's coordinator knows which ranks submitted which tensors. collsync has no coordinator: each collective with an
agreement header (`_ops_base._Agreement`: allreduce, allgather, broadcast, reducescatter and their grouped and async
forms) is numbered on its communicator, and a worker that has waited that long for a header asks every other
worker, on a communicator of its own beside the headers', how many collectives it has called there (and, for a
named operation, which are met by name (`_names`), whether the name waits there too). A worker
answers from any wait inside a collective (`tick`, between two tests of its request); one that answers nothing is
not inside a collective (computing, or stopped). What the warning says, one line per stall:

    collsync: worker 0 has waited 60 s in allreduce (collective #7 here): not called by worker 1 (its last: #6
    allgather); worker 2 answers nothing (not inside a collective)
    collsync: worker 0 has waited 60 s in allreduce 'loss': not called by worker 1 (its last: #6 allgather)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from collsync import ending
from collsync.say import say

QUERY, ANSWER = 7411, 7412
_TICK_S = 0.01  # how often a waiting worker looks for questions (a probe costs about a microsecond)
_ANSWER_S = 2.0  # how long the asking worker gathers answers before it says what it found


def _seconds(name: str, default: float | None) -> float | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be a number of seconds") from None
    return seconds if seconds > 0 else None


@dataclass
class Side:
    """One data communicator's numbering and its stall communicator (`MPI_Comm_dup`, made with the headers')."""

    comm: Any
    called: int = 0  # collectives with a header called on the data communicator
    last: str = ""  # the last one's name
    sends: list[Any] = field(default_factory=list)
    # The keys ('<op>.<name>', `_handles.tensor_name`) of this worker's named operations not yet started (`_names`).
    named: Callable[[], list[str]] = list


class StallCheck:
    """The waits of one worker: `tick(side, seq, what, since)` between two tests of a header's request."""

    def __init__(self, deadline: float | None) -> None:
        self.configure(deadline)
        self.sides: list[Side] = []
        self.hooks: list[Callable[[], None]] = []  # what every wait moves on too (`_names.progress_all`)
        self._next_look = 0.0
        self._asked: dict[int, float] = {}  # id(side) -> when this worker asked (one question per stall)
        self._answers: dict[int, dict[int, tuple[int, str, list[str]]]] = {}
        self._warned: set[tuple[int, int, str | None]] = set()

    def configure(self, deadline: float | None) -> None:
        """The environment's stall times (read now) and the world's deadline, the end where no shutdown time is set."""
        disabled = os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "") not in ("", "0")
        self.warn_s = None if disabled else _seconds("HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0)
        self.end_s = _seconds("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", None) or deadline

    def side(self, stall_comm: Any) -> Side:
        made = Side(stall_comm)
        self.sides.append(made)
        return made

    def tick(
        self, side: Side | None = None, seq: int = 0, what: str = "", since: float = 0.0, name: str | None = None
    ) -> None:
        """Answer the other workers' questions; where this worker waits for header `seq` on `side` (or for the
        named operation `name`) since `since`, ask once past the warning time, say what the answers show, and end
        the job past the end time."""
        for hook in self.hooks:
            hook()
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + _TICK_S
        self._answer()
        if side is None:
            return
        waited = now - since
        # The question goes out a moment before each time, so that the answers are in when it comes.
        due = [t for t in (self.warn_s, self.end_s) if t is not None]
        if due and waited >= min(due) - _ANSWER_S:
            self._ask(side, now)
        if self.warn_s is not None and waited >= self.warn_s and (id(side), seq, name) not in self._warned:
            self._warned.add((id(side), seq, name))
            say(self._report(side, seq, what, waited, name))
        if self.end_s is not None and waited >= self.end_s:
            # The lowest worker waiting here ends the job; the others give its abort a moment to come first (two
            # aborts at once leave the launcher's status to chance).
            answers = self._answers.get(id(side), {})
            waiting = [w for w, answer in answers.items() if _called(answer, seq, name)] + [side.comm.Get_rank()]
            defer = 0.0 if side.comm.Get_rank() == min(waiting) else 2.0
            line = self._report(side, seq, what, waited, name) + "; ending the job"
            ending.end(1, line, comm=side.comm, defer=defer)

    def _answer(self) -> None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        for side in self.sides:
            status = MPI.Status()
            while side.comm.Iprobe(source=MPI.ANY_SOURCE, tag=QUERY, status=status):
                asker = status.Get_source()
                side.comm.recv(source=asker, tag=QUERY)
                side.sends.append(side.comm.isend((side.called, side.last, side.named()), dest=asker, tag=ANSWER))
            while side.comm.Iprobe(source=MPI.ANY_SOURCE, tag=ANSWER, status=status):
                self._answers.setdefault(id(side), {})[status.Get_source()] = side.comm.recv(
                    source=status.Get_source(), tag=ANSWER
                )
            side.sends = [s for s in side.sends if not s.Test()]

    def _ask(self, side: Side, now: float) -> None:
        if id(side) in self._asked:
            return
        self._asked[id(side)] = now
        rank = side.comm.Get_rank()
        for other in range(side.comm.Get_size()):
            if other != rank:
                side.sends.append(side.comm.isend(None, dest=other, tag=QUERY))

    def _report(self, side: Side, seq: int, what: str, waited: float, name: str | None = None) -> str:
        comm = side.comm
        answers = self._answers.get(id(side), {})
        behind, silent = [], []
        for other in range(comm.Get_size()):
            if other == comm.Get_rank():
                continue
            if other not in answers:
                silent.append(other)
            elif not _called(answers[other], seq, name):
                called, last, _ = answers[other]
                behind.append(f"worker {other} (its last: #{called} {last})" if called else f"worker {other}")
        parts = []
        if behind:
            parts.append("not called by " + ", ".join(behind))
        if silent:
            names = ", ".join(f"worker {w}" for w in silent)
            parts.append(f"{names} {'answers' if len(silent) == 1 else 'answer'} nothing (not inside a collective)")
        found = "; ".join(parts) or "every worker has called it (its data is still moving)"
        here = f"(collective #{seq} here)" if name is None else repr(name.partition(".")[2])  # '<op>.<name>'
        return f"collsync: worker {comm.Get_rank()} has waited {waited:.0f} s in {what} {here}: {found}"


def _called(answer: tuple[int, str, list[str]], seq: int, name: str | None) -> bool:
    """Whether a worker's answer shows it has called the collective: its header count reached `seq`, or, for a
    named one, the name waits there too."""
    return answer[0] >= seq if name is None else name in answer[2]


def header_number(side: Side, what: str) -> int:
    """Count a collective with a header on `side`'s data communicator: its number there."""
    side.called += 1
    side.last = what
    return side.called


STALL = StallCheck(None)  # every wait of this process's collectives ticks it (`configure` at `init()`)


def configure(deadline: float | None) -> None:
    """At `init()`: the environment's stall times and the world's deadline."""
    STALL.configure(deadline)
