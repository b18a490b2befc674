"""collsync.torch given bad inputs (issue 36), at any world size: each call is refused with one exception whose
message names the call and what to pass, before any rank waits for another (so every rank raises the same, and
the world still works afterwards: the last test reduces over it)."""

from __future__ import annotations

import traceback

import pytest
import torch

import collsync.torch as hvd
from collsync.torch.config import sync_config


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


def test_a_mode_option_of_the_wrong_type_is_one_line_as_in_the_cli():
    with pytest.raises(ValueError, match=r"^sync=backup: backups='one' is not a whole number$"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), sync="backup", backups="one"
        )
    with pytest.raises(ValueError, match=r"^sync=backup: backups=1.5 is not a whole number$"):
        sync_config("backup", backups=1.5)
    with pytest.raises(ValueError, match=r"^penalty=gap_aware: eta_max='x' is not a number$"):
        sync_config("async", penalty="gap_aware", penalty_options={"eta_max": "x"})
    assert sync_config("backup", backups="1").policy.backups == 1  # converted as collsync-train converts it


def test_a_model_for_the_optimizer_and_a_list_for_a_tensor_are_named():
    with pytest.raises(
        TypeError, match=r"^DistributedOptimizer: expected a torch.optim.Optimizer, got a model \(Linear\)"
    ):
        hvd.DistributedOptimizer(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"^allreduce: expected a torch.Tensor, got list$"):
        hvd.allreduce([1.0, 2.0])


def test_a_second_init_asking_for_another_world_is_refused_the_same_again_is_fine():
    hvd.init()
    hvd.init(sync="bsp", backend="mpi")  # what the first init() set up, spelled out
    with pytest.raises(ValueError, match=r"init: sync='async' differs from sync='bsp' of the first init\(\)"):
        hvd.init(sync="async")
    with pytest.raises(ValueError, match=r"init: servers=1 differs from servers=0 of the first init\(\)"):
        hvd.init(servers=1)
    with pytest.raises(ValueError, match=r"init: deadline=5 differs from deadline=600"):
        hvd.init(deadline=5)
    assert hvd.is_initialized() and hvd.servers() == 0


def test_a_mistyped_name_gets_the_close_one():
    with pytest.raises(ValueError, match=r"sync='asynch' is not one of .* \(did you mean 'async'\?\)$"):
        hvd.init(sync="asynch")
    with pytest.raises(ValueError, match=r"unknown option backup=1 \(did you mean 'backups'\?\) \(options: "):
        sync_config("backup", backup=1)
    with pytest.raises(
        ValueError,
        match=r"penalty='gap-aware' is not one of .* \(did you mean 'gap_aware'( or 'gap_aware_round')?\?\)$",
    ):
        sync_config("async", penalty="gap-aware")


def test_the_mode_option_error_is_one_traceback_without_hydra():
    """Issue 36, item 14: the API's wrong-typed option is what the CLI's is, one line; Python shows it as one
    traceback, with no chained Hydra `InstantiationException` (before: two tracebacks a rank, Hydra's last)."""
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError) as caught:
        hvd.DistributedOptimizer(opt, sync="backup", backups="one")
    shown = "".join(traceback.format_exception(caught.value))
    assert shown.count("Traceback") == 1 and "During handling" not in shown and "Instantiation" not in shown, shown
    assert shown.count("backups='one' is not a whole number") == 1, shown


def test_the_collectives_name_a_non_tensor_and_a_tensor_where_a_list_goes():
    """Issue 36, item 15, for the rest of the family: each call is named (before: `'list' object has no attribute
    'detach'` or `'dim'`, or a tensor's rows reduced one by one where a list was meant)."""
    for call, name in [
        (lambda: hvd.allreduce_async([1.0]), "allreduce_async"),
        (lambda: hvd.allgather([1.0]), "allgather"),
        (lambda: hvd.broadcast([1.0], 0), "broadcast"),
        (lambda: hvd.broadcast_async([1.0], 0), "broadcast_async"),
        (lambda: hvd.partial_allreduce([1.0], 1), "partial_allreduce"),
    ]:
        with pytest.raises(TypeError, match=rf"^{name}: expected a torch.Tensor, got list$"):
            call()
    for call, name in [
        (lambda: hvd.grouped_allreduce([[1.0]]), "grouped_allreduce"),
        (lambda: hvd.grouped_allreduce_([[1.0]]), "grouped_allreduce_"),
        (lambda: hvd.grouped_allgather([[1.0]]), "grouped_allgather"),
        (lambda: hvd.grouped_reducescatter([[1.0]]), "grouped_reducescatter"),
    ]:
        with pytest.raises(TypeError, match=rf"^{name}: expected a list of torch.Tensor, got list at index 0$"):
            call()
    with pytest.raises(TypeError, match=r"^grouped_allreduce: .* got Tensor; pass \[tensor, ...\] \(allreduce takes"):
        hvd.grouped_allreduce(torch.ones(2))
    with pytest.raises(TypeError, match=r"^allreduce: compression='fp16' is not a compressor; pass collsync"):
        hvd.allreduce(torch.ones(2), compression="fp16")


def test_a_model_where_a_state_dict_or_an_optimizer_goes_is_named():
    """`broadcast_parameters(model)` broadcast nothing without a word (a `Sequential` iterates over its layers);
    `broadcast_optimizer_state(model)` ended in `KeyError: 'state'`."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"^broadcast_parameters: .* got a model \(Sequential\); pass model.state_dict"):
        hvd.broadcast_parameters(model, root_rank=0)
    with pytest.raises(TypeError, match=r"^broadcast_parameters: params\['step'\] is int, not a torch.Tensor"):
        hvd.broadcast_parameters({"step": 3, "w": torch.ones(1)}, root_rank=0)
    with pytest.raises(TypeError, match=r"^broadcast_optimizer_state: expected a torch.optim.Optimizer, got a model"):
        hvd.broadcast_optimizer_state(model, root_rank=0)


def test_the_optimizer_wrappers_other_arguments_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))

    def wrap(**kwargs):
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)

    with pytest.raises(TypeError, match=r"^DistributedOptimizer: named_parameters got a model \(Sequential\); pass"):
        wrap(named_parameters=model)
    with pytest.raises(TypeError, match=r"^DistributedOptimizer: named_parameters got dict; pass model.named_param"):
        wrap(named_parameters=dict(model.named_parameters()))
    with pytest.raises(ValueError, match=r"sequence of \(name, parameter\) tuples, got Parameter at index 0; pass"):
        wrap(named_parameters=list(model.parameters()))
    with pytest.raises(ValueError, match=r"^Parameter names in named_parameters must be unique. Found duplicates: w$"):
        wrap(named_parameters=[("w", p) for p in model.parameters()])  # Horovod's words
    with pytest.raises(TypeError, match=r"^DistributedOptimizer: backward_passes_per_step='2' is not a whole number"):
        wrap(backward_passes_per_step="2")
    with pytest.raises(ValueError, match=r"^DistributedOptimizer: gradient_predivide_factor=0 must be a number > 0"):
        wrap(gradient_predivide_factor=0)
    with pytest.raises(TypeError, match=r"^DistributedOptimizer: compression='fp16' is not a compressor; pass"):
        wrap(compression="fp16")
    with pytest.raises(ValueError, match=r"^backup: backups=-1 must be >= 0$"):  # the field's name, not `self.`
        wrap(sync="backup", backups=-1)


def test_inits_arguments_are_typed_before_they_are_compared():
    with pytest.raises(TypeError, match=r"^collsync.torch.init: comm=5 is not an mpi4py communicator; pass an MPI"):
        hvd.init(comm=5)
    with pytest.raises(TypeError, match=r"^collsync.torch.init: servers='1' is not a whole number; pass an int >= 0$"):
        hvd.init(servers="1")
    for deadline in (-1, 0, float("inf"), "60"):
        with pytest.raises(ValueError, match=r"^collsync.torch.init: deadline=.* must be a number of seconds > 0"):
            hvd.init(deadline=deadline)


def test_after_the_refusals_the_world_still_reduces():
    """Every refusal above came before any rank waited for another: the workers are still in step."""
    out = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)
    assert out.item() == sum(range(hvd.size()))
