"""Small runs of the simulator on a synthetic task, shared by the simulator tests."""

from __future__ import annotations

from collsync.data import Batches, synthetic
from collsync.flat import FlatModel
from collsync.loops import Gradients
from collsync.models import mlp
from collsync.policy import SyncPolicy
from collsync.rules import Rule, momentum
from collsync.server import Server
from collsync.sim import Simulator

DATA = synthetic(samples=600, features=10, classes=3, seed=0)


def flat_model(seed: int = 0) -> FlatModel:
    return FlatModel(mlp(input_shape=DATA.input_shape, classes=DATA.classes, hidden=[16], seed=seed))


def simulate(
    policy: SyncPolicy,
    workers: int,
    *,
    steps: int = 30,
    batch_size: int = 8,
    stragglers: object = None,
    optimizer: Rule | None = None,
    penalty: Rule | None = None,
    seed: int = 0,
) -> tuple[Server, Simulator]:
    flat = flat_model(seed)
    sim = Simulator(workers, stragglers, seed)
    server = Server(
        flat.params,
        optimizer or momentum(lr=0.05),
        policy,
        workers,
        penalty=penalty,
        steps=steps,
        ema_decay=0.9,
        trace=sim.trace,
    )
    sim.run(server, Gradients(flat, Batches(DATA, workers, batch_size, seed)))
    return server, sim
