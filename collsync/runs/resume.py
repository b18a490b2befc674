"""Checkpoints of a run and going on from one: what a checkpoint holds (`state`), how a run takes it back
(`restore`), and how it travels between ranks (rank 0 reads the file; the other ranks are sent their part, so no
shared file system is needed). The file format and the signals are `collsync.checkpoint`'s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from collsync.checkpoint import Keeper
from collsync.evaluate import Evaluator
from collsync.runs.parts import Launch, Parts
from collsync.runtime.mpi_checkpoint import ShardStates
from collsync.server import Server
from collsync.trace import Trace

Payload = dict[str, Any]


def keeper(parts: Parts, out_dir: Path, disabled: str | None = None) -> Keeper:
    """The run's checkpoints as configured (`checkpoint.every` updates / `.seconds`, `resume`)."""
    ck = parts.run.checkpoints
    return Keeper(parts.config, out_dir, ck.every, ck.seconds, parts.run.resume, disabled=disabled)


def rank0_keeper(launch: Launch, disabled: str | None = None) -> tuple[Keeper | None, Payload | None]:
    """Rank 0's checkpoints and the checkpoint it resumes from (the other ranks: None, None)."""
    if launch.comm.Get_rank() != 0:
        return None, None
    kept = keeper(launch.parts, launch.out_dir, disabled=disabled)
    return kept, kept.resumed()


def replicas_resume(
    launch: Launch, server: Server, trace: Trace, evaluate: Evaluator
) -> Callable[[Server], None] | None:
    """The serverless runs: every replica resumes from rank 0's checkpoint (sent to them); returns rank 0's
    `on_update`, which evaluates and checkpoints (None on the other ranks)."""
    kept, saved = rank0_keeper(launch)
    shared = launch.comm.bcast(None if saved is None else saved["server"], root=0)
    if kept is None:
        if shared is not None:
            server.load_state_dict(shared)
        return None
    if saved is not None:
        restore(saved, kept, server, trace, evaluate, shift_clock=True)

    def update(s: Server) -> None:
        evaluate(s)
        kept.step(s.version, lambda: state(s, trace, evaluate, {}))

    return update


def state(server: Server, trace: Trace, evaluate: Evaluator | None, driver: dict[str, Any]) -> Payload:
    """A checkpoint's payload: the server, the runtime's own state, the trace so far and the guard's reference."""
    return {
        "server": server.state_dict(),
        "driver": driver,
        "events": list(trace.events),
        "evaluator": {"first_loss": evaluate.first_loss if evaluate is not None else None},
    }


def restore(
    saved: Payload,
    kept: Keeper,
    server: Server,
    trace: Trace | None,
    evaluate: Evaluator | None,
    *,
    shift_clock: bool,
) -> None:
    """Go on from a checkpoint: the server's state, then the trace (marked where it resumed) and the guard."""
    server.load_state_dict(saved["server"])
    if trace is not None:
        trace.resume(saved["events"], shift_clock=shift_clock)
        trace.record("resume", version=server.version, checkpoint=str(kept.source))
    if evaluate is not None:
        evaluate.first_loss = saved["evaluator"]["first_loss"]


def resume_counts(saved: Payload) -> list[tuple[list[int], list[int]]]:
    """Per shard (0..M-1) of a checkpoint: how many gradients it had from each worker, and each one's last round."""
    servers = [saved["server"], *(part["server"] for part in saved.get("shards", []))]
    return [(list(s["received"]), list(s["clocks"])) for s in servers]


def shard_parts(saved: Payload | None, size: int) -> list[Payload | None]:
    """Rank 0's scatter of a checkpoint over the shards' world: shard j's part to rank j, nothing to the others."""
    if saved is None:
        return [None] * size
    parts = list(saved.get("shards", []))
    return [None, *parts, *[None] * (size - 1 - len(parts))]


def shard_state(server: Server, trace: Trace) -> Payload:
    """What shard j >= 1 contributes to rank 0's checkpoint: its server and its trace (for the end-of-run counts)."""
    return {"server": server.state_dict(), "events": list(trace.events)}


def frozen(x: Any) -> Any:
    """A deep copy of a checkpoint payload's tensors and containers (it is written after training went on)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: frozen(v) for k, v in x.items()}
    if isinstance(x, list):
        return [frozen(v) for v in x]
    return x


class ShardCheckpoints:
    """Rank 0's `between` hook with several shards (runtime/mpi_checkpoint.py): when a checkpoint is due (or a
    signal asked for one) ask the other shards for their state at the next version, take its own there, and write
    the file once every state is in; after a signal, stop the run (`Preempted`) once it is written."""

    def __init__(self, kept: Keeper, states: ShardStates, trace: Trace, evaluate: Evaluator | None) -> None:
        self.keeper, self.states, self.trace, self.evaluate = kept, states, trace, evaluate
        self.version: int | None = None  # the version being gathered
        self.own: Payload | None = None
        self.others: list[Payload] | None = None

    def __call__(self, server: Server) -> None:
        if self.version is None:
            if self.keeper.due(server.version):
                self.version = server.version + 1
                self.states.ask(self.version)
            else:
                self.states.collect()  # a shard that finished sends its final state once
            return
        if self.own is None and server.version >= self.version:
            self.own = frozen(state(server, self.trace, self.evaluate, {}))
        others = self.states.collect()
        if others is not None:
            self.others = others
        if self.own is None or self.others is None:
            return
        version = self.own["server"]["version"]
        self.keeper.write(version, {**self.own, "shards": self.others})
        self.version, self.own, self.others = None, None, None
        self.keeper.stop_if_asked(version)


def checkpoints(
    kept: Keeper | None, states: ShardStates | None, trace: Trace, evaluate: Evaluator | None
) -> Callable[[Server], None] | None:
    """A shard's `between` hook: rank 0 writes checkpoints (gathering the other shards' states when there are
    several); shard j >= 1 answers rank 0's asks (and, under collsync.torch, worker 0's)."""
    if kept is not None and states is not None:
        return ShardCheckpoints(kept, states, trace, evaluate)
    if kept is not None:
        return lambda s: kept.step(s.version, lambda: state(s, trace, evaluate, {}))
    if states is not None:
        return lambda s: states.answer(s.version, lambda: shard_state(s, trace))
    return None
