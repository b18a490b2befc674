"""The handles `*_async` returns (Horovod's `synchronize`, `poll`): a collective in flight, named or numbered."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

from collsync.torch import _stall


class _Handle:
    """A collective in flight: `wait()` completes it and returns its result."""

    def __init__(self, request: Any, finish: Callable[[], Any]) -> None:
        self.request, self.finish, self.result, self.done = request, finish, None, False
        self.name: str | None = None  # its `tensor_name`, while in flight (`_register`)

    def test(self) -> bool:
        if not self.done and (self.request is None or self.request.Test()):
            self.result, self.done = self.finish(), True
        return self.done

    def settled(self) -> bool:
        """Whether the operation has completed, found without starting anything: known done (tested or waited), or
        one whose data started after its agreement (`_ops_base._AfterAgreement`, started by a later operation or a
        barrier) and has arrived; an error counts as done. One that needs no agreement (a single worker) is
        settled once tested."""
        if self.done:
            return True
        if not getattr(self.request, "begun", False):
            return False
        try:
            return self.test()
        except Exception:  # noqa: BLE001 - it stays the handle's, for `synchronize` to raise
            return True

    def wait(self) -> Any:
        if not self.done:
            if self.request is not None:
                # Test and yield the core, rather than a blocking Wait: a rank that shares its core with another
                # rank hands it over while it waits, yet reacts within one scheduling slice (sleeping pauses cost
                # milliseconds per reduction here).
                header = getattr(self.request, "header", None)  # an operation still waiting for its agreement
                while not self.request.Test():
                    # The stall check (`_stall`): a wait for a header is watched; every wait answers the others.
                    agreement = header() if header is not None else None
                    if agreement is None:
                        _stall.STALL.tick()
                    else:
                        _stall.STALL.tick(agreement.side, agreement.seq, agreement.what, agreement.since)
                    os.sched_yield()
            self.result, self.done = self.finish(), True
        return self.result


class _Requests:
    """Several MPI requests tested as one (a grouped operation's handle)."""

    def __init__(self, requests: list[Any]) -> None:
        self.requests = requests

    def Test(self) -> bool:  # noqa: N802 - MPI.Request's name, which _Handle calls
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        return bool(MPI.Request.Testall(self.requests))


_HANDLES: dict[int, _Handle] = {}
_IDS = itertools.count(1)
_NAMES: dict[str, int] = {}  # the keys (`tensor_name`) of the operations in flight (until completed) -> handles


def op_kind(what: str) -> str:
    """The operation a call is, as Horovod's tensor names say it: `allreduce_async_`, `allreduce_` and `allreduce`
    are all `allreduce`; `grouped_allreduce_async` is `grouped_allreduce`."""
    return what.removesuffix("_").removesuffix("_async")


def tensor_name(what: str, name: str) -> str:
    """Horovod's name of a named operation, `<op>.<name>` (horovod/torch/mpi_ops_v2.cc, GetOpName): its tensor
    table and its coordinator key operations by it, so one name is one namespace per kind of operation: an
    allreduce 'x' and an allgather 'x' in flight together are two operations, each meeting its own kind on the
    other workers, while two allreduces 'x' (in place or not, blocking or not) are one name twice."""
    return f"{op_kind(what)}.{name}"


def _unnamed(name: str | None, what: str) -> None:
    """Refuse an operation named as one of its kind still in flight (`tensor_name`), before it posts anything
    (Horovod's duplicate-name error: its coordinator matches operations by name, so two in flight under one name
    cannot be told apart). As in Horovod, a name is free again once its operation has completed, synchronized or
    not."""
    key = None if name is None else tensor_name(what, name)
    if key is None or key not in _NAMES:
        return
    held = _HANDLES.get(_NAMES[key])
    if held is None or held.settled():
        del _NAMES[key]
    else:
        raise ValueError(
            f"{what}: requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor "
            f"that is currently being processed (name={name!r}). If you want to request another tensor, use a "
            "different tensor name."
        )


def _register(handle: _Handle, name: str | None = None, what: str = "") -> int:
    """A handle for `synchronize`; a named one holds its name (`tensor_name` of `what` and `name`) until then."""
    key = next(_IDS)
    _HANDLES[key] = handle
    if name is not None:
        handle.name = tensor_name(what, name)
        _NAMES[handle.name] = key
    return key


def _handle(key: int, what: str) -> _Handle:
    if key not in _HANDLES:
        raise ValueError(f"{what}: handle {key!r} is unknown or was synchronized already")
    return _HANDLES[key]


def synchronize(handle: int) -> Any:
    """Wait for an asynchronous operation; returns its output tensor (Horovod's `hvd.synchronize`)."""
    _handle(handle, "synchronize")
    done = _HANDLES.pop(handle)
    if done.name is not None and _NAMES.get(done.name) == handle:
        del _NAMES[done.name]  # the name is free again, whatever the outcome
    return done.wait()


def poll(handle: int) -> bool:
    """True if the asynchronous operation has finished (then `synchronize` returns at once)."""
    return _handle(handle, "poll").test()
