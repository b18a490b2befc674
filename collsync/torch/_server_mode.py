"""The parameter-server modes (`async`, `ssp`, `psp`, `bfasgd`, `specsync`, and any mode once `init` reserved
servers): a worker of the shards on MPI windows (see `collsync.torch.optimizer`).

`step()` pushes this worker's gradient to the shards and pulls fresh parameters into the model. The update is
applied on the servers by collsync's rule made from the user's optimizer's class and hyperparameters
(`server_rule.server_rule`, its lr rescaled by `server_rule.server_lr`, a momentum SGD made DANA where updates take one
gradient each, `server_rule.server_momentum`) plus the penalty (under async, where none is given, DANA-GA with the
Gap in rounds, `server_rule.penalty_for`); the user's optimizer's own state is not used.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from collsync import ending
from collsync.loops import Worker, pull, push
from collsync.lost import grace, silence_bound
from collsync.runtime.mpi_shards import Shards
from collsync.runtime.mpi_world import open_mpi
from collsync.runtime.watchdog import worker_watchdog
from collsync.torch import _stall
from collsync.torch._mode import Mode, one_dtype
from collsync.torch._world import World, shutdown
from collsync.torch.config import SyncConfig, factory
from collsync.torch.server_rule import penalty_for, rule_for
from collsync.torch.speculative import Speculating

if TYPE_CHECKING:
    from mpi4py import MPI


class ServerMode(Mode):
    """A worker of the parameter-server shards: see the module docstring. `step()` is `loops.push` then
    `loops.pull`, the two halves of the worker loop `collsync-train` runs (`loops.run_worker`)."""

    def __init__(
        self,
        st: World,
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
        config: SyncConfig,
        server_state: dict[str, Any] | None = None,
    ) -> None:
        policy = config.policy
        self.name = policy.name
        self.st = st
        workers = st.comm.Get_size()
        policy.check(workers)
        rule = rule_for(optimizer, config, workers)
        self.flat = one_dtype(params, policy.name)
        numel = self.flat.buf.numel()
        if numel < st.servers:
            raise ValueError(f"DistributedOptimizer: {numel} parameters cannot be split over {st.servers} servers")
        self.params = self.flat.read_params().clone()
        shard_states = _shard_states(server_state, st.servers, policy.name)
        if st.comm.Get_rank() == 0:
            # Lazily: `_serve` is the server side (it loads the shard run, and Hydra with it); a worker only sends it
            # the job, and `import collsync.torch` stays light.
            from collsync.torch._serve import Job, send_job

            made, penalty = factory(rule), factory(penalty_for(config, rule))
            assert made is not None  # a rule node, never None
            job = Job(self.params.clone(), policy, made, penalty, workers, state=shard_states)
            send_job(st.world, st.servers, job)
        self.shards = Shards(st.world, numel, st.servers, self.flat.buf.dtype, policy.sent())
        self.mailbox = self.shards.worker_mailbox(policy.pull_fraction, policy.pull_timeout)
        # A worker cut off from its servers blocks inside MPI for good: a thread outside that call ends it once the
        # servers have been silent for its bound (they lost it long before), until it leaves.
        self.watchdog = worker_watchdog(self.shards.mailboxes, st.world.Get_rank(), silence_bound(policy.deadline))
        self.watchdog.__enter__()
        self.worker = Worker(self.mailbox.worker, policy)
        self.lrs = [g.get("lr") for g in optimizer.param_groups]
        self.optimizer = optimizer
        self.deadline = policy.deadline
        self.finished = False
        self.left = False
        self.closed = False
        # PSP: whether the servers were told that this worker waits in another collective of the script (`_away`).
        self.away = False
        if policy.partial_push:
            _stall.STALL.hooks.append(self._away)
        self._lost: list[dict[str, Any]] = []  # the workers the servers lost, as server rank 0 says at `close()`
        self.spec: Speculating | None = None
        if policy.speculation is not None:
            # SpecSync: the messages' communicator, right after the shards, as the servers make theirs.
            self.spec = Speculating(self, st.world, params, policy.speculation)
        self._pull()
        # Every worker's first pull before any worker's first push: they all start from the same version (the
        # servers' initial or saved state), not from one a fast worker already moved.
        st.comm.Barrier()
        if self.spec is not None:
            self.spec.computing()  # the first gradient: no notify before it (Alg. 2 notifies after a push)

    def _pull(self) -> None:
        if pull(self.worker, self.mailbox, self.params).done:
            self.finished = True
        else:
            self.flat.set_params(self.params)  # a fetch B-FASGD skipped leaves `params` as it was: no change

    def synchronize(self) -> None:
        """Nothing to average locally: the gradient goes to the servers at `step()` (clip it in between)."""

    def step(self, base: Callable[[Any], Any], closure: Any, sync: bool) -> Any:
        if self.spec is not None:
            # SpecSync: the closure re-runs on an abort; without one, an abort here throws the gradient away.
            return self.spec.step(closure, self._send)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.finished:
            return loss
        self._send()
        return loss

    def _send(self) -> None:
        """Push this worker's gradient and pull fresh parameters into the model (SpecSync: wait, then notify)."""
        if [g.get("lr") for g in self.optimizer.param_groups] != self.lrs:
            self.lrs = [g.get("lr") for g in self.optimizer.param_groups]
            warnings.warn(
                f"DistributedOptimizer(sync={self.name!r}): the learning rate changed to {self.lrs}, but the "
                "parameter server applies the rule it was given at construction",
                stacklevel=5 if self.spec is not None else 4,
            )
        if self.away:
            self.mailbox.mark_away(False)  # before the push: the servers never see it while they count us away
            self.away = False
        naive_wait = self.spec is not None and self.spec.wait > 0  # SpecSync's naive waiting sleeps before the pull
        push(self.worker, self.mailbox, self.flat.grads().clone(), pull_next=not naive_wait)
        if self.spec is not None:
            self.spec.before_pull()
        self._pull()
        if self.spec is not None:
            self.spec.pulled()

    def _away(self) -> None:
        """PSP, on every wait inside another collective of the script (`_stall.STALL`'s hooks): this worker pushes
        nothing until its next step, and the servers are told once (`Server.pushing`), so that a worker still
        training (with batches left of torch's fixed shard, left out of most rounds and its round skipped ahead) is
        not held for rounds of c pushes the waiting workers will not send: it trains on, and the collective ends."""
        if not self.away and not self.finished:
            self.mailbox.mark_away(True)
            self.away = True

    @property
    def version(self) -> int:
        """The server version of the parameters the model holds (the last pull)."""
        return self.worker.version

    @property
    def lost(self) -> list[dict[str, Any]]:
        """The workers the servers lost (`_serve.tell_lost`), once this optimizer closed."""
        return self._lost

    def join(self) -> int:
        self.leave()
        return self.st.comm.Get_rank()

    def server_state_dict(self) -> dict[str, Any]:
        from collsync.runtime.mpi_checkpoint import ShardStates

        if self.st.comm.Get_rank() != 0:
            raise ValueError("server_state_dict(): only worker 0 (rank() == 0) asks the servers for their state")
        if self.closed:
            raise ValueError("server_state_dict(): this optimizer is closed and its servers gone; ask before close()")

        def seen_the_end() -> None:
            if not self.left and self.mailbox.peek().done:
                self.leave()  # training ended (another worker left a round policy): the servers wait for us

        # The shards' state protocol (as collsync-train's checkpoints); this end only asks, so it is not collective.
        asking = ShardStates(self.st.world, self.st.servers, asker=self.st.servers, dup=False)
        shards = asking.now(seen_the_end)
        return {"format": 1, "sync": self.name, "shards": shards}

    def leave(self) -> None:
        if not self.left:
            self.mailbox.leave()
            if self._away in _stall.STALL.hooks:
                _stall.STALL.hooks.remove(self._away)
            self.left = True
            self.finished = True
            self.watchdog.__exit__(None, None, None)
            if self.spec is not None:
                self.spec.leave()

    def close(self) -> None:
        self.leave()
        self.closed = True
        if self.spec is not None:
            # The scheduler answers every worker's BYE once all came: the end marker, then its counts.
            self.spec.drain(self.deadline)
        # Lazily, as in `__init__`: the server side's module.
        from collsync.torch._serve import receive_lost

        # Server rank 0 says which workers it lost once every live worker left: none of them comes to close.
        self._lost = receive_lost(self.st.world)
        self.shards.close(timeout=self.deadline if self._lost else None)
        if self._lost:
            exit_without_finalize(self.st.world, self.deadline)
        if self.spec is not None:
            self.spec.close()


def _shard_states(saved: dict[str, Any] | None, servers: int, name: str) -> list[dict[str, Any]] | None:
    """The per-shard states of `server_state_dict()`'s result, checked against this world."""
    if saved is None:
        return None
    if not isinstance(saved, dict) or saved.get("format") != 1 or "shards" not in saved:
        raise ValueError("server_state: not what DistributedOptimizer.server_state_dict() returns")
    if len(saved["shards"]) != servers:
        raise ValueError(f"server_state: saved from {len(saved['shards'])} server(s), this world has {servers}")
    if saved.get("sync") != name:
        raise ValueError(f"server_state: saved under sync={saved.get('sync')!r}, resumed under sync={name!r}")
    return list(saved["shards"])


_leaving = False  # exit_without_finalize was called


def exit_without_finalize(world: MPI.Comm | None = None, deadline: float | None = None) -> None:
    """After a worker was lost, end this process at exit without `MPI_Finalize`: MPICH's waits on every rank of
    the world, the lost one included, for ever. The script runs to its end as usual; then `shutdown()` (the server
    ranks are released), a word to server rank 0 that this script ended (`_serve.say_bye`), and the process exits
    0 (`collsync.ending`: an exception that ends the script ends the job, as everywhere). Under MPICH a worker
    first waits (at most twice the grace) for server rank 0 to end the job (`MPI_Abort(0)` once every live worker's
    script ended): mpiexec would otherwise wait for ever on a lost worker's host it cannot reach, and a rank that
    leaves early may have the others stopped while they still run their scripts. Without `world` (serverless: no
    server rank 0), only the exit without `MPI_Finalize`."""
    global _leaving
    if _leaving:
        return
    _leaving = True
    ending.at_exit(shutdown)  # nothing if the script called it (an optimizer closed by `close()` alone has servers)
    if world is not None:
        from collsync.torch._serve import say_bye  # lazily, as in `__init__`: the server side's module

        ending.at_exit(lambda: say_bye(world, grace(deadline)))
    ending.leave_at_exit(linger=2 * grace(deadline) if world is not None and not open_mpi() else 0.0)
