"""SpecSync's protocol as pure code (004_..., Alg. 1-2): the scheduler's counts and re-syncs on scripted push
schedules, Algorithm 1 on hand-made push logs, and the config's refusals."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from collsync.cli import CONF_DIR, user_error
from collsync.flat import FlatModel
from collsync.loops import Gradients
from collsync.models import mlp
from collsync.policy import specsync
from collsync.runtime.mpi_specsync import install_safe_points
from collsync.specsync import Aborted, Scheduler, Speculation, tune
from collsync.torch.config import from_config, sync_config


def cherrypick(workers: int, abort_time: float, abort_rate: float) -> Scheduler:
    return Scheduler(workers, Speculation(abort_time=abort_time, abort_rate=abort_rate))


def test_scheduler_counts_the_others_pushes_in_each_period_and_resyncs_above_m_times_the_rate():
    # m = 3, ABORT_TIME 1, ABORT_RATE 0.5: a re-sync needs more than 1.5 pushes, i.e. 2, within a period.
    s = cherrypick(3, abort_time=1.0, abort_rate=0.5)
    s.notify(0, 0.0)  # w0's period (0, 1]
    s.notify(1, 0.3)  # w1's period (0.3, 1.3]; counts in w0's
    s.notify(2, 0.6)  # w2's period (0.6, 1.6]; counts in w0's and w1's
    assert s.counts == [2, 1, 0]
    assert s.due() == 1.0
    assert s.expire(0.99) == []
    assert s.expire(1.0) == [(0, 1)]  # w0 saw 2 > 1.5 pushes: re-sync its first notified iteration
    s.notify(0, 1.1)  # counts in w1's and w2's periods; restarts w0's
    assert s.counts == [0, 2, 1]
    assert s.expire(1.3) == [(1, 1)]  # 2 > 1.5
    assert s.expire(1.6) == []  # w2: 1 push
    s.notify(1, 2.1)  # exactly at w0's expiry: counted (the period is (start, start + ABORT_TIME])
    assert s.counts[0] == 1
    assert s.expire(2.1) == []
    assert (s.notifies, s.resyncs, s.iteration) == (5, 2, [2, 2, 1])


def test_a_workers_own_notify_restarts_its_period_and_forgets_its_count():
    s = cherrypick(3, abort_time=1.0, abort_rate=0.3)  # more than 0.9: one push is enough
    s.notify(0, 0.0)
    s.notify(1, 0.2)
    s.notify(0, 0.5)  # w0 pushed again before its timer fired: its old period belonged to the pushed gradient
    assert s.timers[0] == 1.5 and s.counts[0] == 0
    assert s.expire(1.2) == [(1, 1)]  # w1 saw w0's push at 0.5
    assert s.expire(1.5) == []  # w0's new period saw nothing


def test_rate_above_one_never_resyncs_and_one_worker_has_no_one_to_count():
    s = cherrypick(4, abort_time=10.0, abort_rate=1.01)
    for k in range(40):
        s.notify(k % 4, 0.1 * k)
    assert max(s.counts) == 3 and s.expire(100.0) == []
    alone = cherrypick(1, abort_time=1.0, abort_rate=1e-6)
    for k in range(5):
        alone.notify(0, float(k))
        assert alone.expire(k + 1.0) == []


def test_algorithm_1_on_a_hand_made_log():
    # m = 3. s_i = start of each worker's last complete iteration, T_i its span: slope (m-1) sum 1/T_i = 2, T = 10/3.
    log = [(0.0, 0), (0.5, 1), (0.7, 2), (0.8, 1), (2.5, 1), (4.0, 0), (5.0, 2), (5.1, 0), (5.2, 1), (9.0, 2)]
    starts = {0: 0.0, 1: 0.5, 2: 5.0}
    spans = {0: 4.0, 1: 2.0, 2: 4.0}
    # Right-aligned candidates (others' pushes after s_i, at most T): w0 0.5 0.7 0.8 2.5; w1 0.2; w2 0.1 0.2.
    # F~ = rank - 2 Delta: 0.1 -> 0.8, 0.2 -> 2.6, 0.5 -> 3.0, 0.7 -> 3.6, 0.8 -> 4.4, 2.5 -> 2.0.
    result = tune(log, starts, spans, 3)
    assert result is not None
    assert result.abort_time == pytest.approx(0.8)
    assert result.gain == pytest.approx(4.4)
    assert result.abort_rate == pytest.approx(0.8 * 2 / (10 / 3 * 3))  # Delta (m-1) / (T m) = 0.16


def test_algorithm_1_has_nothing_to_tune_without_spans_or_later_pushes():
    assert tune([(0.0, 0), (1.0, 1)], {}, {}, 2) is None
    assert tune([(0.0, 0)], {0: 0.0}, {0: 1.0}, 2) is None  # nobody pushed after w0's start
    assert tune([(0.0, 0), (1.0, 1)], {0: 0.0}, {0: 1.0}, 1) is None  # one worker: no peers to miss or uncover


def test_adaptive_scheduler_tunes_at_each_epoch_end_from_its_own_log():
    s = Scheduler(2, Speculation(adaptive=True))
    s.notify(0, 1.0)
    s.notify(1, 1.5)  # epoch 1 ends: no complete iteration yet, nothing to tune on, no speculation
    assert (s.epoch, s.abort_time, s.timers) == (1, None, [None, None])
    s.notify(0, 2.0)
    s.notify(0, 3.0)
    s.notify(1, 3.5)  # epoch 2 ends. s_0 = 2, s_1 = 1.5; T_0 = 1, T_1 = 2 (T = 1.5); slope 1 x (1 + 1/2) = 1.5
    # Candidates: w0: 3.5 - 2 = 1.5; w1: 2 - 1.5 = 0.5, 3 - 1.5 = 1.5. F~(0.5) = 1 - 0.75, F~(1.5) = 3 - 2.25.
    assert s.epoch == 2
    assert s.abort_time == pytest.approx(1.5)
    assert s.abort_rate == pytest.approx(1.5 * 1 / (1.5 * 2))
    assert s.timers == [None, pytest.approx(5.0)]  # w1's notify closed the epoch and opened its period, tuned
    assert s.tunings == [{"t": 3.5, "epoch": 2, "abort_time": s.abort_time, "abort_rate": s.abort_rate}]


def test_scheduler_state_round_trips_and_goes_on_identically():
    times = [0.0, 0.1, 0.15, 0.3, 0.45, 0.5, 0.8, 0.9, 1.0, 1.05]
    a = cherrypick(3, abort_time=0.4, abort_rate=0.3)
    for k, t in enumerate(times[:5]):
        a.notify(k % 3, t)
        a.expire(t)
    saved = a.state_dict()
    before = repr(saved)
    b = cherrypick(3, abort_time=0.4, abort_rate=0.3)
    b.load_state_dict(saved)
    out_a: list[tuple[int, int]] = []
    out_b: list[tuple[int, int]] = []
    for k, t in enumerate(times[5:], start=5):
        for s, out in ((a, out_a), (b, out_b)):
            s.notify(k % 3, t)
            out += s.expire(t + 0.2)
    assert out_a == out_b and out_a and a.state_dict() == b.state_dict()
    assert repr(saved) == before  # a copy, not a view of the scheduler that went on


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sync.abort_rate=0"], "specsync: abort_rate=0 must be in (0, inf)"),
        (["sync.adaptive=false", "sync.abort_time=-1", "sync.abort_rate=0.1"], "abort_time=-1 must be > 0 seconds"),
        (["sync.abort_time=2"], "adaptive=true tunes abort_time and abort_rate itself; abort_time=2 must be null"),
        (["sync.adaptive=false", "sync.abort_time=2"], "specsync: abort_rate=null; Cherrypick needs both"),
        (["sync.wait=-0.5"], "specsync: wait=-0.5 must be >= 0 seconds"),
        (["sync.base=bsp"], "specsync: base='bsp' must be 'async' or 'ssp'"),
        (["sync.max_lead=2"], "specsync: max_lead=2 bounds SSP's lead; it needs base=ssp"),
        (["sync.scheduler=thread"], "specsync: scheduler='thread' must be 'server' (co-located) or 'rank'"),
    ],
)
def test_bad_values_are_refused_naming_the_key(overrides, message):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=["sync=specsync", *overrides])
    with pytest.raises(Exception) as info:
        instantiate(cfg.sync)
    text = user_error(info.value)  # what collsync-train prints, as it prints it
    assert text is not None and message in text


def test_specsync_runs_over_asp_and_ssp():
    asp = specsync(adaptive=False, abort_time=1.0, abort_rate=0.5)
    assert not asp.rounds and asp.quorum_for(8) == 1 and asp.speculation.speculates
    ssp = specsync(base="ssp", max_lead=2)
    assert ssp.rounds and ssp.max_lead == 2 and ssp.speculation.adaptive
    naive = specsync(adaptive=False, wait=0.3)
    assert naive.speculation.wait == 0.3 and not naive.speculation.speculates


def test_safe_points_abort_a_gradient_between_layers():
    flat = FlatModel(mlp(input_shape=(4,), classes=3, hidden=[8], seed=0))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    calls: list[int] = []
    abort_at = [None]

    def check() -> None:
        calls.append(len(calls))
        if len(calls) == abort_at[0]:
            raise Aborted

    handles = install_safe_points(flat.module, check)
    leaves = sum(1 for m in flat.module.modules() if next(m.children(), None) is None)
    grads = Gradients(flat, None)
    whole = grads.at(flat.params.clone(), x, y)
    assert len(calls) == leaves + len(list(flat.module.parameters()))  # every layer forward, every gradient
    for k in (2, leaves + 1):  # in the forward pass, then in the backward pass
        calls.clear()
        abort_at[0] = k
        with pytest.raises(Aborted):
            grads.at(flat.params.clone(), x, y)
        assert len(calls) == k  # it stopped there
    abort_at[0] = None
    assert torch.equal(grads.at(flat.params.clone(), x, y), whole)  # an aborted gradient leaves nothing behind
    for h in handles:
        h.remove()


def test_collsync_torch_takes_specsync_but_refuses_a_scheduler_rank_of_its_own():
    """Through collsync.torch the scheduler runs in server rank 0's loop; a rank of its own would be a third role in
    a world whose roles are fixed at init(), so it is refused in one line (config object and Hydra config alike)."""

    assert sync_config(specsync()).policy.speculation is not None
    with pytest.raises(ValueError, match="runs in collsync-train only"):
        sync_config(specsync(scheduler="rank"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=["sync=specsync", "sync.scheduler=rank", "runtime=mpi"])
    with pytest.raises(ValueError, match="runs in collsync-train only"):
        from_config(cfg)
