"""A `Server`'s checkpoint state: everything it needs to go on exactly where it was, in plain types.

Tensors, numbers, lists and dicts only (rule states as nested lists, see `rules.base.plain`), so that
`torch.load(weights_only=True)` reads a checkpoint back. Workers lost in a run (`Server.lose`) are not part of it: a
resumed run is launched with its workers anew.
"""

from __future__ import annotations

from typing import Any, Protocol

from collsync.rules.base import SIGNAL, plain, unplain
from collsync.types import Arrival, Flat


class Server(Protocol):
    """What a checkpoint holds of a `collsync.server.Server`, typed by its shape: the server imports this module,
    so this one names the server's state here instead of importing it (mypy checks that the server fits)."""

    params: Flat
    ema: Flat | None
    workers: int
    version: int
    opt_state: Any
    pen_state: Any
    pending: dict[int, list[Arrival]]
    applied: int
    dropped: int
    received: list[int]
    clocks: list[int]
    contributed: list[int]
    signal: float
    _history: dict[int, Flat]
    _last: dict[int, Flat]
    _oldest: list[int]
    _armed: int | None
    _view: Flat | None

    def _optimizer_stats(self) -> dict[str, float]: ...


def state_of(server: Server) -> dict[str, Any]:
    """`server`'s state, for `load_into` a server built with the same config."""
    return {
        "params": server.params,
        "ema": server.ema,
        "version": server.version,
        "opt_state": plain(server.opt_state),
        "pen_state": plain(server.pen_state),
        "pending": {k: [a._asdict() for a in batch] for k, batch in server.pending.items()},
        "applied": server.applied,
        "dropped": server.dropped,
        "history": dict(server._history),
        "last": dict(server._last),
        "oldest": list(server._oldest),
        "armed": server._armed,
        "received": list(server.received),
        "clocks": list(server.clocks),
        "contributed": list(server.contributed),
    }


def load_into(server: Server, state: dict[str, Any]) -> None:
    """Continue `server` from `state_of` a server built with the same config (the shapes are checked here; the
    config by `checkpoint.check_config`)."""
    if state["params"].shape != server.params.shape or len(state["received"]) != server.workers:
        raise ValueError(
            f"checkpoint: a server of {state['params'].numel()} parameters and {len(state['received'])} workers "
            f"cannot resume one of {server.params.numel()} and {server.workers}"
        )
    server.params.copy_(state["params"])
    if server.ema is not None:
        server.ema.copy_(state["ema"] if state["ema"] is not None else server.params)
    server.version = int(state["version"])
    server.opt_state = unplain(server.opt_state, state["opt_state"], "optimizer")
    server.pen_state = unplain(server.pen_state, state["pen_state"], "penalty")
    server.pending = {int(k): [Arrival(**a) for a in batch] for k, batch in state["pending"].items()}
    server.applied, server.dropped = int(state["applied"]), int(state["dropped"])
    server._history = {int(v): t for v, t in state["history"].items()}
    server._last = {int(w): t for w, t in state["last"].items()}
    server._oldest = list(state["oldest"])
    server._armed = state["armed"]
    server.received, server.clocks = list(state["received"]), list(state["clocks"])
    # Checkpoints written before `contributed` was kept: the last round each worker sent stands in for it.
    server.contributed = list(state.get("contributed", [max(0, c + 1) for c in server.clocks]))
    server._view = None
    server.signal = server._optimizer_stats().get(SIGNAL, 0.0)
