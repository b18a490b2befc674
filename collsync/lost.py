"""Lost workers on the server's side: a worker that owes a gradient and sent nothing for the policy's `deadline`
(stopped, partitioned, dead) is lost (`Server.lose`); the others go on without it where the policy allows
(`SyncPolicy.tolerates`), else the run stops naming the workers it waited on. At the end, lost workers are not
waited for. `loops.run_server` drives these; they read nothing but the server and its mailbox."""

from __future__ import annotations

import time
from collections.abc import Callable

from collsync import keepalive
from collsync.runtime import ServingMailbox
from collsync.server import Server
from collsync.types import Arrival

# How long rank 0 may take to write the run folder (evaluation, trace, plots) once a deadline fired, a divergence
# or a signal stopped it: the other ranks wait that long before their own error aborts the world (rank 0 aborts it
# as soon as it is done), and a worker waits that much longer than the deadlines on a silent server.
SAVE_GRACE_S = 30.0


def grace(deadline: float | None) -> float:
    """`SAVE_GRACE_S`, shorter where the user asked for short deadlines (they would rather fail fast)."""
    return SAVE_GRACE_S if deadline is None else min(SAVE_GRACE_S, max(3.0, 3 * deadline))


def silence_bound(deadline: float | None) -> float | None:
    """How long a worker waits on a silent server (its watchdog's bound): twice the server's deadline plus the
    grace, so that the server's own deadline comes first."""
    return None if deadline is None else 2 * deadline + grace(deadline)


# How long a server waits at the end for its live workers to stop before it goes on without waiting on them
# (`close_serving`'s `waiting`): a worker mid-step stops within a step; one stopped waits for the deadline.
END_PATIENCE_S = 5.0

# The least a server sleeps between two looks for lost workers (the deadline counts in seconds).
LOST_POLL_S = 0.05


def _owes(server: Server, worker: int) -> bool:
    """Whether the update under way waits on `worker`: none of its gradients is buffered. (One that is waits on
    the server: at BSP's barrier, or SSP's bound.)"""
    return not any(a.worker == worker for batch in server.pending.values() for a in batch)


def until_silent(server: Server, heard: list[float], last: float) -> float:
    """Seconds until the quietest live worker (the one heard from longest ago, `heard`; `last` if none is live)
    reaches the deadline, never under `LOST_POLL_S`: when the server must wake up to look for lost workers."""
    deadline = keepalive.patience(server.policy.deadline)
    assert deadline is not None
    quiet = min((heard[w] for w in range(server.workers) if w not in server.lost), default=last)
    return max(LOST_POLL_S, quiet + deadline - time.monotonic())


def lose_silent(server: Server, mailbox: ServingMailbox, heard: list[float], now: float) -> bool:
    """Lose every worker that owes a gradient and sent nothing for the deadline (stopped, partitioned, dead; one
    that left is not silent, it is gone). True if one was lost; a TimeoutError naming the workers waited on where
    the policy cannot go on without it (`Server.lose`). Once the launcher said that a rank died, silent for
    `keepalive.NOTICE_PATIENCE_S` is enough where the deadline is longer."""
    deadline = keepalive.patience(server.policy.deadline)
    assert deadline is not None
    # A worker whose gradient is buffered waits on the server (BSP's barrier, SSP's bound), not the other way round:
    # its silence starts only once that gradient is applied. Else, the round it waited for applied at last (another
    # worker lost, say), it would owe the next gradient having been "silent" all the while, and be lost at once.
    # A worker away (PSP: in another collective of its script, `Server.pushing`) is not silent either: it said so.
    for w in {a.worker for batch in server.pending.values() for a in batch} | server.away:
        heard[w] = max(heard[w], now)
    silent = [w for w in range(server.workers) if w not in server.lost and now - heard[w] >= deadline]
    if silent:
        left = mailbox.departed()
        silent = [w for w in silent if _owes(server, w) and w not in left]
    for w in silent:
        rank, host = mailbox.locate(w)
        if not server.lose(w, rank, host):
            raise TimeoutError(stuck_message(server, mailbox.describe, None if server.policy.rounds else silent))
        mailbox.lose(w)
    return bool(silent)


def close_serving(
    server: Server,
    mailbox: ServingMailbox,
    waiting: Callable[[list[int]], None] | None = None,
    patience: float = END_PATIENCE_S,
) -> list[Arrival]:
    """After the final publish: wait for the live workers to stop (lost ones are not waited for), at most the
    deadline; those still out then are lost too, where the policy can do without them. `waiting(out)`: called once
    with the workers still out after `patience` seconds, where the deadline is longer: a worker mid-step stops
    within a step, one stopped or cut off only at the deadline (600 s by default), and what was trained must not
    wait on it (rank 0 of collsync-train writes the run folder there). Once the launcher said that a rank died, the
    wait is `keepalive.patience`'s."""
    deadline = keepalive.patience(server.policy.deadline)
    start = time.monotonic()
    if waiting is not None and (deadline is None or patience < deadline) and not _stopped(server, mailbox, patience):
        waiting(still_out(server, mailbox))
    rest = None if deadline is None else max(0.0, deadline - (time.monotonic() - start))
    try:
        return _close(server, mailbox, rest)
    except TimeoutError:
        out = still_out(server, mailbox)
        if not out or not all(server.lose(w, *mailbox.locate(w)) for w in out):
            raise
        return mailbox.close(deadline, server.lost)


def _stopped(server: Server, mailbox: ServingMailbox, patience: float) -> bool:
    """Whether every live worker stopped within `patience` seconds. What they send meanwhile is taken as the
    server loop takes it (after the end: dropped, reason "finished"), so that no worker waits on its slot."""
    end = time.monotonic() + patience
    while still_out(server, mailbox):
        left = end - time.monotonic()
        if left <= 0:
            return False
        arrival = mailbox.recv(timeout=min(LOST_POLL_S, left))
        if arrival is not None:
            server.accept(arrival)
            if not server.holds(arrival.grad):
                mailbox.recycle(arrival.grad)
    return True


def _close(server: Server, mailbox: ServingMailbox, timeout: float | None) -> list[Arrival]:
    """`mailbox.close`, passing `lost` only when there are: a mailbox wrapped by a caller may take just the timeout."""
    return mailbox.close(timeout, server.lost) if server.lost else mailbox.close(timeout)


def still_out(server: Server, mailbox: ServingMailbox) -> list[int]:
    """The workers neither lost nor gone: those the end of the run still waits for."""
    left = mailbox.departed()
    return [w for w in range(server.workers) if w not in server.lost and w not in left]


def stuck_message(server: Server, describe: Callable[[list[int]], str], silent: list[int] | None = None) -> str:
    """The run cannot go on: name the workers waited on (the `silent` ones, else those missing from the round)."""
    got = {a.worker for a in server.pending.get(server.version, [])}
    missing = silent or [w for w in range(server.workers) if w not in got]
    named = describe(missing)
    return (
        f"{server.policy.name}: round {server.version} got no gradient within deadline={server.policy.deadline}s; "
        f"waiting on {named}"
    )


def regroup(server: Server, lost: list[int], ranks: list[int], hosts: list[str]) -> None:
    """Serverless replicas that went on in place without the workers `lost` (a communicator shrunk under ULFM,
    `runtime.mpi_ulfm`): each is traced `lost` (its rank and host, the last update it was part of), then a `world`
    event gives the n' workers left, renumbered 0..n'-1 in order as a restart's are (`runs.resume.refit`); every
    per-worker count keeps the survivors' own, and the quorum is the policy's for n'. Nothing can be buffered: the
    replicas apply each mean at once."""
    if server.pending:
        raise ValueError("server: regroup() with gradients buffered; only serverless replicas regroup")
    trace = server.trace
    for worker, rank, host in zip(lost, ranks, hosts, strict=True):
        if trace is not None:
            trace.record("lost", worker=worker, rank=rank, host=host, last_update=server.contributed[worker])
    kept = [w for w in range(server.workers) if w not in lost]
    state = server.state_dict()
    for key in ("oldest", "received", "clocks", "contributed"):
        state[key] = [state[key][w] for w in kept]
    state["last"] = {kept.index(int(w)): g for w, g in state["last"].items() if int(w) in kept}
    was, server.workers = server.workers, len(kept)
    server.quorum, server.full = server.policy.quorum_for(len(kept)), server.policy.full_for(len(kept))
    server.load_state_dict(state)
    if trace is not None:
        trace.record("world", version=server.version, workers=len(kept), was=was)
