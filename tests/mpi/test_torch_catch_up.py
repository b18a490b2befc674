"""Serverless backup's catch-up at any world size: a worker late for its round applies every round the others
completed meanwhile, and `collsync.torch.DistributedSampler` hands the batches out round by round (`ledger.Ledger`):
the late worker's go to the others, each of an epoch's batches is in exactly one applied mean, and the epoch takes
the rounds they need. Where the sampler cannot follow the ledger (a DataLoader fetching ahead, several backward
passes a step) it skips the batches of the rounds caught up on instead. Every replica still applies every round
(identical parameters), every worker ends each epoch at the same round, and the slow worker computes fewer batches;
with a learning-rate scheduler attached it does not catch up unless told to (`catch_up=True`)."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import collsync.torch as hvd

EPOCHS, BATCH, BATCHES = 2, 4, 10  # per worker and epoch


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


def run(scheduled: bool = False, passes: int = 1, loaders: int = 0, **options) -> dict:
    """Train with the last worker 10x slower (`passes` batches, each a backward pass, a step); what each worker saw,
    gathered."""
    size, rank = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(0)
    rows = BATCH * BATCHES * size
    data = TensorDataset(torch.randn(rows, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (rows,)))
    sampler = hvd.DistributedSampler(data, batch_size=BATCH, drop_last=True)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True, num_workers=loaders)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    named = model.named_parameters()
    opt = hvd.DistributedOptimizer(
        opt, named, backward_passes_per_step=passes, sync="backup", backups=1, margin=None, **options
    )
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduled else None
    ledger = opt._collsync.rounds.ledger
    if ledger is not None:
        ledger.log = []  # the chunks used, in order
    slow = rank == size - 1
    computed, rounds = 0, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                if i % passes == 0:
                    opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                time.sleep(0.05 if slow else 0.005)
                computed += 1
                if i % passes == passes - 1:
                    opt.step()
            rounds.append(opt._collsync.round)
            if schedule is not None:
                schedule.step()  # once per epoch
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mine = {
        "params": params,
        "computed": computed,
        "caught_up": opt.caught_up * passes,  # in batches
        "rounds": rounds,
        "warned": [str(w.message) for w in caught if "learning-rate scheduler" in str(w.message)],
        "used": None if ledger is None or not sampler.follows else ledger.log,
    }
    opt.close()
    return {"all": hvd.allgather_object(mine), "slow": size - 1, "passes": passes}


def check_replicas(got: dict) -> None:
    everyone, per_epoch, n = got["all"], BATCHES // got["passes"], len(got["all"])
    assert all(torch.equal(w["params"], everyone[0]["params"]) for w in everyone)  # bit for bit
    # Every worker ends each epoch at the same round.
    assert all(w["rounds"] == everyone[0]["rounds"] for w in everyone), everyone
    used = everyone[0]["used"]
    if used is None:  # the batches of rounds caught up on skipped: the computed and caught up make the epoch
        assert everyone[0]["rounds"] == [per_epoch * (e + 1) for e in range(EPOCHS)], everyone
        assert all(w["computed"] + w["caught_up"] == EPOCHS * BATCHES for w in everyone)
        return
    # The ledger: each batch (chunk g: batch g // n of shard g % n) used once, n - 1 a round (margin=None); every
    # epoch's are used, the late worker's shard too, but fewer than n left at the last epoch's end; an epoch that
    # left some has them used first in the next.
    per = n * BATCHES
    assert all(w["used"] == used for w in everyone) and len(used) == len(set(used))
    assert len(used) == everyone[0]["rounds"][-1] * (n - 1) and max(used) < EPOCHS * per
    left = set(range(EPOCHS * per)) - set(used)
    assert len(left) < n and all(g >= (EPOCHS - 1) * per for g in left), left
    assert {g % n for g in used} == set(range(n))


needs_two = pytest.mark.skipif(
    __import__("mpi4py.MPI").MPI.COMM_WORLD.Get_size() < 2, reason="a late worker needs another one"
)


@needs_two
def test_a_late_worker_applies_the_rounds_it_missed_and_skips_their_batches():
    got = run()
    check_replicas(got)
    slow = got["all"][got["slow"]]
    assert slow["caught_up"] > 0 and slow["computed"] + slow["caught_up"] == slow["rounds"][-1], slow
    assert not slow["warned"] and slow["used"] is not None
    assert slow["rounds"][0] > BATCHES  # the epoch took more rounds than bsp's: n - 1 batches in each


@needs_two
def test_a_loader_fetching_ahead_gets_torchs_shards_and_the_late_worker_skips():
    got = run(loaders=1)
    check_replicas(got)
    slow = got["all"][got["slow"]]
    assert slow["used"] is None and slow["caught_up"] > 0 and slow["computed"] < EPOCHS * BATCHES, slow


@needs_two
def test_with_backward_passes_a_round_skipped_is_that_many_batches():
    got = run(passes=2)
    check_replicas(got)
    assert got["all"][got["slow"]]["caught_up"] > 0


@needs_two
def test_with_a_scheduler_attached_the_late_worker_computes_every_batch_unless_told():
    got = run(scheduled=True)
    check_replicas(got)
    slow = got["all"][got["slow"]]
    assert slow["caught_up"] == 0 and slow["computed"] == slow["rounds"][-1]  # a batch every round
    assert len(slow["warned"]) == 1 and "catch_up=True" in slow["warned"][0]
    # A per-epoch schedule: every worker applies each epoch's rounds at that epoch's rate, so catch-up is safe.
    told = run(scheduled=True, catch_up=True)
    check_replicas(told)
    assert told["all"][told["slow"]]["caught_up"] > 0


def test_catch_up_is_an_option_of_serverless_backup_only():
    with pytest.raises(ValueError, match="catch_up=True is for serverless backup"):
        hvd.sync_config("bsp", catch_up=True)
    with pytest.raises(ValueError, match="catch_up='yes' must be True, False or None"):
        hvd.sync_config("backup", catch_up="yes")
    assert hvd.sync_config("backup", catch_up=False).catch_up is False
