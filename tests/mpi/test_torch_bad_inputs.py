"""collsync.torch given bad inputs (issue 36), at any world size: each call is refused with one exception whose
message names the call and what to pass, before any rank waits for another."""

from __future__ import annotations

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
    with pytest.raises(TypeError, match=r"^DistributedOptimizer: expected a torch.optim.Optimizer, got Linear; pass"):
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
    with pytest.raises(ValueError, match=r"penalty='gap-aware' is not one of .* \(did you mean 'gap_aware'\?\)$"):
        sync_config("async", penalty="gap-aware")
