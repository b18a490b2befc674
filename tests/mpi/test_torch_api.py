"""collsync.torch at any world size (every rank a worker, no servers): Horovod's collectives and
DistributedOptimizer under bsp and backup, checked against one process computing the same thing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import collsync.torch as hvd
from collsync.policy import bsp
from collsync.torch.server_rule import rule_for, server_lr, server_momentum


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


def batch(rank: int, rows: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(rows, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (rows,), generator=g)


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def test_rank_size_and_roles():
    from mpi4py import MPI

    assert hvd.is_initialized() and hvd.size() == MPI.COMM_WORLD.Get_size()
    assert hvd.rank() == MPI.COMM_WORLD.Get_rank() == hvd.world_rank()
    assert 0 <= hvd.local_rank() < hvd.local_size() <= hvd.size()
    assert hvd.cross_size() * hvd.local_size() == hvd.size() and hvd.role() == "worker" and hvd.servers() == 0


def test_allreduce_average_sum_scale_and_async():
    n, r = hvd.size(), hvd.rank()
    t = torch.full((3,), float(r + 1), dtype=torch.float64)
    total = n * (n + 1) / 2
    assert torch.equal(hvd.allreduce(t), torch.full((3,), total / n, dtype=torch.float64))
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum), torch.full((3,), total, dtype=torch.float64))
    scaled = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert torch.equal(scaled, torch.full((3,), total, dtype=torch.float64))
    assert t[0] == r + 1  # allreduce returns a new tensor
    handle = hvd.allreduce_async_(t, op=hvd.Sum)
    out = hvd.synchronize(handle)
    assert out is t and t[0] == total
    with pytest.raises(ValueError, match="unknown"):
        hvd.poll(handle)
    ints = hvd.allreduce(torch.tensor([r], dtype=torch.int64), op=hvd.Sum)
    assert ints.item() == sum(range(n))


def test_allreduce_float16_rounds_after_each_addition_like_horovod():
    x = torch.tensor([1.0 + 2**-10], dtype=torch.float16)  # the smallest step above 1 in float16
    out = hvd.allreduce(x, op=hvd.Sum)
    expected = x.clone()
    for _ in range(hvd.size() - 1):
        expected = (expected.float() + x.float()).half()
    assert out.dtype == torch.float16 and torch.equal(out, expected)


def test_bfloat16_is_reduced_in_float32_rounded_after_each_addition():
    """numpy has no bfloat16: its raw words travel and each addition is done in float32 and rounded to nearest-even
    (the same x on every rank, so the order of the additions cannot change the result)."""
    x = torch.tensor([1.0 + 2**-7, 3.0, -0.5], dtype=torch.bfloat16)  # 1 + 2**-7: bfloat16's smallest step above 1
    expected = x.clone()
    for _ in range(hvd.size() - 1):
        expected = (expected.float() + x.float()).bfloat16()
    out = hvd.allreduce(x, op=hvd.Sum)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    exact = torch.tensor([float(hvd.rank() + 1)], dtype=torch.bfloat16)  # small whole numbers: exact sums
    n = hvd.size()
    assert hvd.allreduce(exact).item() == (n + 1) / 2
    gathered = hvd.allgather(exact)
    assert gathered.dtype == torch.bfloat16 and gathered.tolist() == [float(r + 1) for r in range(n)]
    assert hvd.broadcast(exact, root_rank=0).item() == 1.0


def test_allreduce_carries_gradients():
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    (hvd.allreduce(x * (hvd.rank() + 1), op=hvd.Sum).sum()).backward()
    assert torch.equal(x.grad, torch.full((2,), float(hvd.size() * (hvd.rank() + 1)), dtype=torch.float64))


def test_grouped_allreduce_allgather_broadcast_objects():
    n, r = hvd.size(), hvd.rank()
    a, b = torch.tensor([float(r)]), torch.tensor([[1.0, 2.0]]) * r
    ga, gb = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    assert ga.item() == sum(range(n)) and torch.equal(gb, torch.tensor([[1.0, 2.0]]) * sum(range(n)))
    rows = hvd.allgather(torch.full((r + 1, 2), float(r)))  # uneven first dimension
    assert rows.shape == (n * (n + 1) // 2, 2)
    assert rows[:, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    root = n - 1
    got = hvd.broadcast(torch.tensor([float(r)]), root_rank=root)
    assert got.item() == root
    mine = torch.tensor([float(r)])
    hvd.broadcast_(mine, root_rank=0)
    assert mine.item() == 0.0
    assert hvd.broadcast_object({"from": r}, root_rank=root) == {"from": root}
    assert hvd.allgather_object(r * 10) == [k * 10 for k in range(n)]
    hvd.barrier()
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(torch.zeros(1), root_rank=n)


def test_what_horovod_has_and_collsync_not_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(torch.zeros(1), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.reducescatter(torch.zeros(hvd.size()), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(torch.optim.SGD(net().parameters(), lr=0.1), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="start_timeline"):
        hvd.start_timeline("timeline.json")
    with pytest.raises(ValueError, match="ProcessSet"):
        hvd.allreduce(torch.zeros(1), process_set=object())


def test_options_beside_a_mode_merge_and_conflicts_are_refused_by_name():
    """DistributedOptimizer(..., penalty=..., backups=...) after init(sync=...) chose the mode: `sync_config`
    merges them with the SyncConfig init made, key by key."""
    merged = hvd.sync_config(hvd.sync_config("async"), penalty="gap_aware")
    assert merged.name == "async" and merged.penalty is not None and merged.penalty["name"] == "gap_aware"
    assert merged.servers == 1
    assert hvd.sync_config(hvd.sync_config("backup"), backups=2).policy.backups == 2
    chosen = hvd.sync_config("backup", backups=2)
    assert hvd.sync_config(chosen, backups=2) == chosen  # the same value again is no conflict
    with pytest.raises(ValueError, match=r"backups=1 conflicts with backups=2"):
        hvd.sync_config(chosen, backups=1)
    with pytest.raises(ValueError, match=r"penalty='staleness_aware' conflicts with penalty='gap_aware'"):
        hvd.sync_config(merged, penalty="staleness_aware")
    with pytest.raises(ValueError, match="unknown option max_lead=2"):
        hvd.sync_config(hvd.sync_config("async"), max_lead=2)
    with pytest.raises(ValueError, match="made from a SyncPolicy"):
        hvd.sync_config(hvd.sync_config(bsp()), penalty="gap_aware")


@pytest.mark.parametrize(
    ("sync", "options", "factor"),
    [
        ("bsp", {}, 1.0),
        ("backup", {"backups": 1}, 0.75),
        ("async", {}, 0.25),
        ("bfasgd", {}, 0.25),
        ("psp", {"pushes": 3}, 0.75),
        ("ssp", {"max_lead": 3}, 0.25),
        ("ssp", {"max_lead": 1}, 0.5),
    ],
)
def test_server_lr_rescales_horovods_lr_to_the_gradients_an_update_averages(sync, options, factor):
    """A script's lr x size() is for a mean of size() gradients; the server averages g and reads up to s rounds
    stale: lr x g / size() / (1 + s) (server_rule.server_lr), for 4 workers here."""
    policy = hvd.sync_config(sync, **options).policy
    rule = {"_target_": "collsync.rules.momentum", "lr": 0.08, "momentum": 0.9, "weight_decay": 0.0}
    assert server_lr(rule, policy, 4) == {**rule, "lr": 0.08 * factor}
    assert "lr" not in server_lr({"_target_": "collsync.rules.dana"}, policy, 4)


@pytest.mark.parametrize("max_lead", [1, 2, 3])
def test_server_lr_leaves_the_lookaheads_lr_to_the_rule(max_lead):
    """Under SSP the look-ahead momentum divides each round's step by its staleness itself (collsync.rules.lookahead,
    001_... Alg. 3), so the servers' lr is Horovod's lr x n / n, not divided by the bound as well."""
    policy = hvd.sync_config("ssp", max_lead=max_lead).policy
    rule = {"_target_": "collsync.rules.lookahead", "lr": 0.08, "momentum": 0.9, "weight_decay": 0.0}
    assert server_lr(rule, policy, 4) == rule


def test_ssp_through_collsync_torch_bounds_the_lead_at_one_unless_told():
    """collsync.torch's ssp defaults to max_lead 1 (config.SSP_MAX_LEAD); a bound given is kept, also when options
    merge after init(sync=...); collsync-train's conf/sync/ssp.yaml keeps its 3."""
    assert hvd.sync_config("ssp").policy.max_lead == 1
    assert hvd.sync_config("ssp", max_lead=3).policy.max_lead == 3
    assert hvd.sync_config(hvd.sync_config("ssp"), penalty="gap_aware").policy.max_lead == 1
    assert hvd.sync_config(hvd.sync_config("ssp", max_lead=2), penalty="gap_aware").policy.max_lead == 2
    assert hvd.sync_config("specsync", base="ssp").policy.max_lead == 3


@pytest.mark.parametrize(
    ("sync", "options", "dana"),
    [
        ("async", {}, True),
        ("specsync", {}, True),  # over ASP by default: one gradient an update
        ("async", {"quorum": 2}, False),  # an update averages two workers' gradients: one v_i cannot hold them
        ("bfasgd", {}, False),  # fetch skipping needs the rule that re-applies a worker's last gradient
        ("psp", {"pushes": 3}, False),
        ("ssp", {"max_lead": 0}, False),  # SSP at bound 0 is BSP: nothing stale to look ahead over
        ("bsp", {}, False),
    ],
)
def test_server_momentum_is_dana_where_an_update_is_one_gradient(sync, options, dana):
    """The torch optimizer's momentum becomes DANA (per-worker momentum, a look-ahead read) with its lr, gamma and
    weight decay where the servers apply one gradient at a time; elsewhere, and for a rule without momentum, the
    rule is unchanged (server_rule.server_momentum)."""
    policy = hvd.sync_config(sync, **options).policy
    momentum = {"_target_": "collsync.rules.momentum", "lr": 0.02, "momentum": 0.9, "weight_decay": 1e-4}
    nesterov = {**momentum, "_target_": "collsync.rules.nesterov"}
    want = {**momentum, "_target_": "collsync.rules.dana"}
    for rule in (momentum, nesterov):
        assert server_momentum(rule, policy, 4) == (want if dana else rule)
    plain = {"_target_": "collsync.rules.sgd", "lr": 0.02, "weight_decay": 0.0}
    assert server_momentum(plain, policy, 4) == plain


@pytest.mark.parametrize(("sync", "options"), [("ssp", {}), ("ssp", {"max_lead": 3}), ("specsync", {"base": "ssp"})])
def test_server_momentum_looks_ahead_over_ssps_stale_rounds(sync, options):
    """Under SSP's rounds (and SpecSync over them) a momentum SGD becomes the look-ahead momentum with its lr, gamma,
    weight decay and Nesterov flag; plain SGD stays."""
    policy = hvd.sync_config(sync, **options).policy
    momentum = {"_target_": "collsync.rules.momentum", "lr": 0.02, "momentum": 0.9, "weight_decay": 1e-4}
    want = {**momentum, "_target_": "collsync.rules.lookahead"}
    assert server_momentum(momentum, policy, 4) == {**want, "nesterov": False}
    assert server_momentum({**momentum, "_target_": "collsync.rules.nesterov"}, policy, 4) == {**want, "nesterov": True}
    plain = {"_target_": "collsync.rules.sgd", "lr": 0.02, "weight_decay": 0.0}
    assert server_momentum(plain, policy, 4) == plain


def test_rule_for_a_torch_optimizer_rescales_makes_dana_and_refuses_bfasgd_by_name():
    """The servers' rule from a Horovod script's SGD (lr x size(), momentum 0.9) at 4 workers: async's is DANA at
    lr / 4; a named rule is taken as it is; B-FASGD without one is refused saying what to pass
    (server_rule.rule_for)."""
    sgd = torch.optim.SGD(net().parameters(), lr=0.08, momentum=0.9)
    rule = rule_for(sgd, hvd.sync_config("async"), 4)
    assert rule == {"_target_": "collsync.rules.dana", "lr": 0.02, "momentum": 0.9, "weight_decay": 0.0}
    assert rule_for(sgd, hvd.sync_config("psp", pushes=2), 4)["_target_"] == "collsync.rules.momentum"
    ssp = rule_for(sgd, hvd.sync_config("ssp"), 4)  # the look-ahead at the full lr: bound 1
    assert ssp == {"_target_": "collsync.rules.lookahead", "lr": 0.08, "momentum": 0.9, "weight_decay": 0.0} | {
        "nesterov": False
    }
    assert rule_for(sgd, hvd.sync_config("async", scaled_lr=False), 4)["lr"] == 0.08
    assert rule_for(sgd, hvd.sync_config("bfasgd", rule="fasgd"), 4)["_target_"] == "collsync.rules.fasgd"
    with pytest.raises(ValueError, match=r"sync='bfasgd'.*SGD has not; pass rule='fasgd'"):
        rule_for(sgd, hvd.sync_config("bfasgd"), 4)


def test_server_modes_without_reserved_servers_say_how():
    with pytest.raises(ValueError, match=r"init\(sync='async'\)"):
        hvd.DistributedOptimizer(torch.optim.SGD(net().parameters(), lr=0.1), sync="async")
    with pytest.raises(ValueError, match="unknown option pushes=3"):
        hvd.sync_config("backup", pushes=3)
    with pytest.raises(ValueError, match="'nope' is not one of"):
        hvd.sync_config("nope")


def reference(steps: int, passes: int = 1, lr: float = 0.1) -> list[torch.Tensor]:
    """One process: SGD with momentum on every rank's batches concatenated (the mean gradient of n equal batches
    is the gradient of their concatenation)."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for p in range(passes):
            xs, ys = zip(*(batch(r, seed=step * passes + p) for r in range(hvd.size())), strict=True)
            (F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)) / 1.0).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def train(sync: str, steps: int, passes: int = 1, **options) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(100 + hvd.rank())
    model = net(seed=hvd.rank())  # different on every rank until broadcast
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), backward_passes_per_step=passes, sync=sync, **options
    )
    for step in range(steps):
        opt.zero_grad()
        for p in range(passes):
            x, y = batch(hvd.rank(), seed=step * passes + p)
            F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()], opt


def same_everywhere(params: list[torch.Tensor]) -> None:
    gathered = hvd.allgather_object([p.clone() for p in params])
    for other in gathered:
        assert all(torch.equal(a, b) for a, b in zip(other, params, strict=True))


def test_bsp_is_sgd_on_the_concatenated_batch():
    ours, opt = train("bsp", steps=5)
    same_everywhere(ours)
    assert isinstance(opt, torch.optim.SGD) and opt.sync_mode == "bsp"
    for a, b in zip(ours, reference(5, passes=1, lr=0.1), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_backward_passes_accumulate_and_too_many_fail_like_horovod():
    ours, opt = train("bsp", steps=3, passes=2)
    same_everywhere(ours)
    model = net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        F.cross_entropy(model(x), y).backward()
    opt.synchronize()  # the pending reduction still runs on every rank
    with opt.skip_synchronize():
        opt.step()


def test_backup_without_backups_equals_bsp_and_drops_nothing():
    bsp, _ = train("bsp", steps=4)
    backup, opt = train("backup", steps=4, backups=0)
    same_everywhere(backup)
    for a, b in zip(bsp, backup, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert opt.dropped == 0 and opt.sync_mode == "backup"


@pytest.mark.skipif(__import__("mpi4py.MPI").MPI.COMM_WORLD.Get_size() < 2, reason="a backup needs 2 workers")
def test_backup_workers_keep_replicas_identical_and_count_drops():
    params, opt = train("backup", steps=6, backups=1, margin=None)  # the paper's fixed b: n - b every round
    same_everywhere(params)
    drops = hvd.allgather_object(opt.dropped)
    assert sum(drops) == 6  # one gradient of every round is late (or not waited for)


def test_join_lets_a_worker_with_fewer_batches_finish():
    model = net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    for step in range(hvd.rank() + 1):  # rank r has r + 1 batches
        opt.zero_grad()
        x, y = batch(hvd.rank(), seed=step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    last = opt.join()
    assert last == hvd.size() - 1


def test_partial_allreduce_returns_the_mean_and_who_contributed():
    n = hvd.size()
    result = hvd.partial_allreduce(torch.full((2, 2), float(hvd.rank())), quorum=n)
    assert result.mean.shape == (2, 2) and result.contributors == list(range(n)) and result.dropped == []
    assert torch.allclose(result.mean, torch.full((2, 2), (n - 1) / 2))
    with pytest.raises(ValueError, match="quorum"):
        hvd.partial_allreduce(torch.zeros(2), quorum=n + 1)


def test_sync_batch_norm_equals_batch_norm_on_the_concatenated_batch():
    n, r = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(5)
    full = torch.randn(4 * n, 3, 2, generator=g, dtype=torch.float64)
    weights = torch.randn(4 * n, 3, 2, generator=g, dtype=torch.float64)
    ref = nn.BatchNorm1d(3).double()
    x_ref = full.clone().requires_grad_()
    ref_out = ref(x_ref)
    (ref_out * weights).sum().backward()
    ours = hvd.SyncBatchNorm(3).double()
    x = full[4 * r : 4 * r + 4].clone().requires_grad_()
    out = ours(x)
    (out * weights[4 * r : 4 * r + 4]).sum().backward()
    torch.testing.assert_close(out, ref_out.detach()[4 * r : 4 * r + 4], rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad[4 * r : 4 * r + 4], rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.running_var, ref.running_var, rtol=0, atol=1e-12)
    weight_grad = hvd.allreduce(ours.weight.grad, op=hvd.Sum)
    torch.testing.assert_close(weight_grad, ref.weight.grad, rtol=0, atol=1e-12)


def test_sparse_gradients_with_and_without_sparse_as_dense():
    emb = nn.Embedding(4, 2, sparse=True).double()
    hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
    before = emb.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0), sparse_as_dense=True)
    emb(torch.tensor([hvd.rank() % 4])).sum().backward()
    opt.step()
    touched = {r % 4 for r in range(hvd.size())}
    for row in range(4):
        moved = not torch.equal(emb.weight[row].detach(), before[row])
        assert moved == (row in touched)
    opt.close()
    # Without sparse_as_dense, Horovod's sparse path: the mean of the workers' sparse gradients, still sparse.
    plain = hvd.DistributedOptimizer(torch.optim.SGD(nn.Embedding(4, 2, sparse=True).double().parameters(), lr=1.0))
    weight = plain.param_groups[0]["params"][0]
    start = weight.detach().clone()
    weight.grad = torch.full((4, 2), float(hvd.rank()), dtype=torch.float64).to_sparse()
    plain.step()
    mean = (hvd.size() - 1) / 2
    assert weight.grad.is_sparse and torch.allclose(weight.grad.to_dense(), torch.full((4, 2), mean).double())
    assert torch.allclose(weight.detach(), start - mean)
    plain.close()
