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
    """Rank 0's checkpoints and the checkpoint it resumes from (the other ranks: None, None), refitted to this
    world's number of workers when a restart runs on fewer (or more) ranks than the run that wrote it."""
    if launch.comm.Get_rank() != 0:
        return None, None
    kept = keeper(launch.parts, launch.out_dir, disabled=disabled)
    saved = resumed(kept, launch.parts)
    return kept, None if saved is None else refit(saved, launch.workers)


def resumed(kept: Keeper, parts: Parts) -> Payload | None:
    """`kept.resumed()`, refused when the other kind of runtime wrote it: the simulator's checkpoint holds its
    clock, event queue and workers (`driver`), an MPI run's none, and the one counts simulated seconds, the other
    wall seconds, which one trace or summary cannot mix (`runtime=auto` is the one or the other by the launch)."""
    saved = kept.resumed()
    if saved is None:
        return None
    names = {True: "the simulator (simulated seconds)", False: "an MPI run (wall seconds)"}
    there, here = bool(saved.get("driver")), parts.runtime.kind == "sim"
    if there != here:
        raise ValueError(
            f"resume: {kept.source} was written by {names[there]}, and this run is {names[here]}: a run goes on "
            "only in the kind of runtime that wrote it (start afresh without resume=, or resume it as it was run)"
        )
    return saved


def refit(saved: Payload, workers: int) -> Payload:
    """A checkpoint of n workers made to go on with `workers` = n' (a restart on the ranks left after one was lost).

    What carries over is the server's: the step (version V), the parameters, EMA and every rule's state. What was
    per worker cannot, since the workers are numbered anew: gradients buffered for round V (the update not yet
    applied) are dropped (traced as `drop`, reason `restart`) and computed again by the new workers; each new
    worker starts round V at batch index j = max over the old workers of the gradients they had sent for applied
    updates (V under bsp: one batch per round), so `data.Batches` re-derives its rows with n' workers (an epoch is
    then M // (n' b) steps). A `world` event marks the change in every shard's trace, which `check_trace` reads
    as the new number of workers. Unchanged when n' = n."""
    servers = [saved["server"], *(part["server"] for part in saved.get("shards", []))]
    if len(servers[0]["received"]) == workers:
        return saved
    traces = [list(saved["events"]), *(list(part["events"]) for part in saved.get("shards", []))]
    refitted = [_refit_server(s, workers, events) for s, events in zip(servers, traces, strict=True)]
    parts = zip(saved.get("shards", []), refitted[1:], traces[1:], strict=True)
    shards = [{**part, "server": s, "events": events} for part, s, events in parts]
    return {**saved, "server": refitted[0], "events": traces[0], **({"shards": shards} if shards else {})}


def _refit_server(state: Payload, workers: int, events: list[dict[str, Any]]) -> Payload:
    """One server's (shard's) state for `workers` new workers; `events` (its trace) gets the drops and the
    `world` event."""
    version, was = int(state["version"]), len(state["received"])
    t = float(events[-1]["t"]) if events else 0.0
    pending = [a for batch in state["pending"].values() for a in batch]
    owed = [0] * was  # per old worker: buffered gradients, counted in `received` but dropped now
    for a in pending:
        owed[a["worker"]] += 1
        events.append(
            {"t": t, "ev": "drop", "worker": a["worker"], "clock": a["clock"], "version": a["version"]}
            | {"server": version, "reason": "restart"}
        )
    events.append({"t": t, "ev": "world", "version": version, "workers": workers, "was": was})
    start = max((r - o for r, o in zip(state["received"], owed, strict=True)), default=version)
    history = {v: view for v, view in state["history"].items() if int(v) >= version}
    return {
        **state,
        "pending": {},
        "dropped": int(state["dropped"]) + len(pending),
        "history": history,
        "last": {w: g for w, g in state["last"].items() if int(w) < workers},
        "oldest": [version] * workers,
        "received": [start] * workers,
        "clocks": [version - 1] * workers,
        "contributed": [version] * workers,
    }


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
