"""Horovod's elastic state objects (`horovod.common.elastic.State` and `ObjectState`, `horovod.torch.elastic.
TorchState`) on collsync.

As in Horovod, `commit()` keeps a copy of the state (`save()`) that `restore()` goes back to, `sync()` makes every
rank equal to rank 0, and reset callbacks run after the world changed. collsync adds one thing: where a commit
folder is set (`_commit`: `commit_dir=` or `collsync-run`'s `COLLSYNC_ELASTIC_DIR`), rank 0 also writes each commit
to a file, atomically, so that the job `collsync-run` relaunches on the ranks left after a rank died starts from it
(`hvd.elastic.run` reads it back): without ULFM no process outlives the lost rank to keep the commit in memory
(under ULFM the survivors do, and `run` restores it in place).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from collsync.torch import _world
from collsync.torch.elastic import _commit
from collsync.torch.elastic.sampler import ElasticSampler
from collsync.torch.ops import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)


class State:
    """What an elastic run tracks across ranks (Horovod's `State`): subclasses say how to `save`, `restore` and
    `sync` it; this class adds the reset callbacks, `commit()` and the commit file.

    `bcast_object` and `get_rank` default to collsync's `broadcast_object` and `rank` (Horovod requires them).
    `commit_dir` is the folder each commit is written to (see `collsync.torch.elastic._commit`)."""

    def __init__(
        self,
        bcast_object: Callable[..., Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        *,
        commit_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or _world.rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._commits = 0
        self._commit_dir = _commit.commit_dir(commit_dir)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Call each of `callbacks` after every reset (Horovod: a worker added or removed; here, a relaunch on the
        ranks left, or a `HostsUpdatedInterrupt` the script raised). A typical one rescales the learning rate by
        `hvd.size()`."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After a reset: `reset()`, then the callbacks in the order they were registered (Horovod's order)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: Any = None) -> None:
        """Horovod's driver calls this when hosts come or go. collsync has no such driver: a world only shrinks
        (in place under ULFM, where the step raises `HorovodInternalError`; else by a relaunch), and nothing calls
        it."""

    def commit(self) -> None:
        """Keep the current state as the one `restore()` returns to (Horovod's `commit`: `save()`, then
        `check_host_updates()`), and where a commit folder is set, write it there (rank 0; atomically). As in
        Horovod, commit less often than every batch when the state is large: a commit copies it, and here writes
        it too."""
        self.save()
        self._commits += 1
        if self._commit_dir is not None and self._rank() == 0:
            _commit.write(self._commit_dir, {"commits": self._commits, "size": _world.size(), **self.saved()})
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise `HostsUpdatedInterrupt` when the set of hosts changed (Horovod: a notification from its driver,
        agreed across ranks by a broadcast). collsync's world changes only when a rank dies: by a relaunch, which no
        running process sees, or in place under ULFM, which the step reports as `HorovodInternalError`; so there is
        never an update to report here and no collective is spent on asking."""

    @property
    def commits(self) -> int:
        """How many commits this state has made, counting those of the jobs before a relaunch."""
        return self._commits

    @property
    def commit_path(self) -> Path | None:
        """The commit file, or None when commits stay in memory."""
        return None if self._commit_dir is None else self._commit_dir / _commit.ELASTIC_FILE

    def load_commit(self) -> dict[str, Any] | None:
        """On rank 0: the last commit written to the commit folder, made this state's saved state and restored
        (None, and nothing changed, without a folder or a commit in it). Call `sync()` after it on every rank."""
        if self._commit_dir is None or self._rank() != 0:
            return None
        found = _commit.read(self._commit_dir)
        if found is not None:
            self.load_saved(found)
            self._commits = int(found["commits"])
            self.restore()
        return found

    def saved(self) -> dict[str, Any]:
        """What the last `save()` kept, as a picklable dict (written to the commit file)."""
        raise NotImplementedError(f"{type(self).__name__}.saved")

    def load_saved(self, saved: dict[str, Any]) -> None:
        """Make `saved` (one `saved()` dict) the state `restore()` returns to."""
        raise NotImplementedError(f"{type(self).__name__}.load_saved")

    def save(self) -> None:
        """Keep a copy of the state in host memory."""
        raise NotImplementedError(f"{type(self).__name__}.save")

    def restore(self) -> None:
        """Go back to the last committed state, undoing what was changed since."""
        raise NotImplementedError(f"{type(self).__name__}.restore")

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError(f"{type(self).__name__}.sync")

    def reset(self) -> None:
        """Whatever follows a reset before the state is synchronised (Horovod: nothing by default)."""


class ObjectState(State):
    """Plain picklable Python objects, one per keyword argument, kept as attributes (Horovod's `ObjectState`):
    `save` copies their current values, `restore` sets them back, `sync` broadcasts rank 0's."""

    def __init__(
        self,
        bcast_object: Callable[..., Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        *,
        commit_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        self._saved_state: dict[str, Any] = kwargs
        self._set_attrs()
        super().__init__(bcast_object, get_rank, commit_dir=commit_dir)

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def saved(self) -> dict[str, Any]:
        return {"objects": self._saved_state}

    def load_saved(self, saved: dict[str, Any]) -> None:
        objects = saved.get("objects", {})
        unknown = sorted(set(objects) - set(self._saved_state))
        if unknown:
            raise ValueError(
                f"collsync.torch.elastic: rank {self._rank()}: the commit holds attribute(s) {unknown} this state "
                f"does not have ({sorted(self._saved_state)}): it was written by another script"
            )
        self._saved_state = {**self._saved_state, **objects}

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))


class _Handler:
    """How `TorchState` saves, restores and synchronises one torch object (Horovod's `StateHandler`)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.kept: Any = None
        self.save()

    def save(self) -> None:
        self.kept = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.kept))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0))

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def save(self) -> None:
        """The sampler's state, with the indices every rank recorded (`record_indices`) joined, as older Horovod
        did: the next world must skip what any rank processed."""
        kept = copy.deepcopy(self.value.state_dict())
        if self.value.by_indices:
            kept["processed_indices"] = sorted(set().union(*allgather_object(set(self.value.processed_indices))))
        self.kept = kept


_HANDLERS: list[tuple[type, type[_Handler]]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (torch.optim.lr_scheduler.LRScheduler, _Handler),
    (ElasticSampler, _SamplerHandler),
]


def _handler(value: Any) -> _Handler | None:
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler(value)
    return None


def _served(optimizer: Any) -> str | None:
    """The sync mode of a collsync optimizer whose state lives on parameter servers, else None."""
    from collsync.torch._server_mode import ServerMode  # lazily: the optimizer's modules import collsync.torch

    mode = getattr(optimizer, "_collsync", None)
    return str(getattr(mode, "name", "?")) if isinstance(mode, ServerMode) else None


class TorchState(ObjectState):
    """A PyTorch training's state (Horovod's `TorchState`): `model`, `optimizer` and any other keyword argument.
    Models, optimizers, learning-rate schedulers and `ElasticSampler`s are kept by their `state_dict()` (synced by
    `broadcast_parameters`, `broadcast_optimizer_state`, `broadcast_object`); every other value is a plain
    picklable attribute, as in `ObjectState`. Assigning a new model or optimizer to the attribute saves it.

    A `DistributedOptimizer` in a parameter-server mode is refused: its state is the servers', which a relaunch on
    fewer ranks carries over through `server_state_dict()`, not through the workers' commits."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        commit_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        mode = _served(optimizer)
        if mode is not None:
            raise NotImplementedError(
                f"collsync.torch.elastic.TorchState: rank {_world.rank()}: the optimizer runs sync={mode!r} on "
                "parameter servers, whose state the servers hold: use hvd.elastic with bsp or serverless backup, "
                "or resume a server mode from DistributedOptimizer.server_state_dict()"
            )
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(commit_dir=commit_dir, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def saved(self) -> dict[str, Any]:
        return {**super().saved(), "handlers": {name: h.kept for name, h in self._handlers.items()}}

    def load_saved(self, saved: dict[str, Any]) -> None:
        kept = saved.get("handlers", {})
        if sorted(kept) != sorted(self._handlers):
            raise ValueError(
                f"collsync.torch.elastic: rank {self._rank()}: the commit holds torch objects {sorted(kept)}, this "
                f"state has {sorted(self._handlers)}: it was written by another script"
            )
        for name, handler in self._handlers.items():
            handler.kept = kept[name]
        super().load_saved(saved)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)
