"""`hvd.elastic` in one process: the state objects' commit, restore and commit file, `run`'s resume and resets,
`ElasticSampler`'s dealing out of what an epoch has not processed, and `collsync-run`'s side of it."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import collsync.torch as hvd
from collsync import supervise
from collsync.torch import _world
from collsync.torch.elastic import _commit


@pytest.fixture(scope="module", autouse=True)
def world() -> Iterator[None]:
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture(autouse=True)
def no_commit_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(supervise.ELASTIC_ENV, raising=False)


def as_world(monkeypatch: pytest.MonkeyPatch, size: int, rank: int) -> None:
    monkeypatch.setattr(_world, "size", lambda: size)
    monkeypatch.setattr(_world, "rank", lambda: rank)


def model_and_opt(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_once(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()


# -- ElasticSampler ----------------------------------------------------------------------------------------------


def dealt(sampler: hvd.elastic.ElasticSampler, monkeypatch: pytest.MonkeyPatch, size: int) -> list[list[int]]:
    """Each rank's indices of a `size`-rank world, from the sampler's state."""
    state = sampler.state_dict()
    out = []
    for rank in range(size):
        as_world(monkeypatch, size, rank)
        other = hvd.elastic.ElasticSampler(sampler.dataset, seed=sampler.seed)
        other.load_state_dict(state)
        out.append(list(other))
    return out


def test_the_sampler_deals_horovods_order_and_a_smaller_world_gets_only_what_was_not_processed(monkeypatch):
    data = list(range(96))
    as_world(monkeypatch, 4, 1)
    sampler = hvd.elastic.ElasticSampler(data, seed=5)
    sampler.set_epoch(2)
    order = list(range(96))
    random.Random(5 + 2).shuffle(order)  # Horovod's order: random.Random(seed + epoch)
    assert list(sampler) == order[1::4] and len(sampler) == 24
    for batch in range(3):
        sampler.record_batch(batch, 8)  # three batches of 8 on each of 4 ranks
    assert sampler.state_dict() == {"epoch": 2, "processed_num": 96}
    sampler.record_batch(3, 2)
    assert sampler.state_dict()["processed_num"] == 96 + 8
    sampler.set_epoch(2)
    sampler.record_batch(0, 5)  # 20 processed by the 4-rank world
    parts = dealt(sampler, monkeypatch, 3)
    left = order[20:]
    assert sorted(i for part in parts for i in part) == sorted(left + left[:2])  # padded to 3 x 26, as Horovod
    assert not set(order[:20]) & {i for part in parts for i in part}
    sampler.set_epoch(3)
    assert sampler.state_dict() == {"epoch": 3, "processed_num": 0}


def test_recorded_indices_are_skipped_too_and_a_bad_state_is_refused(monkeypatch):
    as_world(monkeypatch, 2, 0)
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    sampler.record_indices([0, 3, 4])
    assert sampler.state_dict()["processed_indices"] == [0, 3, 4]
    sampler.load_state_dict(sampler.state_dict())
    assert list(sampler) == [1, 5, 7, 9]
    with pytest.raises(ValueError, match="processed_num"):
        sampler.load_state_dict({"epoch": 1})


# -- State, ObjectState, TorchState ------------------------------------------------------------------------------


def test_restore_undoes_what_changed_since_the_commit_copies_included():
    state = hvd.elastic.ObjectState(epoch=0, seen=[1])
    state.epoch, state.seen = 3, [1, 2]
    state.commit()
    state.epoch = 4
    state.seen.append(9)  # an in-place change after the commit
    state.restore()
    assert (state.epoch, state.seen, state.commits) == (3, [1, 2], 1)


def test_torch_state_restores_model_optimizer_and_attributes_and_syncs_in_one_world():
    model, opt = model_and_opt()
    state = hvd.elastic.TorchState(model, opt, epoch=0)
    train_once(model, opt)
    state.epoch = 1
    state.commit()
    kept = [p.detach().clone() for p in model.parameters()]
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    train_once(model, opt)
    state.epoch = 2
    state.restore()
    assert all(torch.equal(a, b) for a, b in zip(kept, model.parameters(), strict=True))
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum) and state.epoch == 1
    state.sync()  # one rank: its own state
    assert all(torch.equal(a, b) for a, b in zip(kept, model.parameters(), strict=True))


def test_a_commit_is_written_atomically_by_rank_0_and_read_back_by_a_new_state(tmp_path, monkeypatch):
    model, opt = model_and_opt()
    state = hvd.elastic.TorchState(model, opt, commit_dir=tmp_path, epoch=0)
    assert state.commit_path == tmp_path / supervise.ELASTIC_FILE
    train_once(model, opt)
    state.epoch = 7
    state.commit()
    state.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == [supervise.ELASTIC_FILE]  # no temporary file left
    fresh_model, fresh_opt = model_and_opt(seed=1)
    fresh = hvd.elastic.TorchState(fresh_model, fresh_opt, commit_dir=tmp_path, epoch=0)
    found = fresh.load_commit()
    assert found is not None and (found["commits"], found["size"]) == (2, 1)
    assert fresh.epoch == 7 and fresh.commits == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True))
    assert fresh_opt.state_dict()["state"][0]["momentum_buffer"] is not None
    # Another rank neither writes nor reads: it gets rank 0's commit from sync().
    as_world(monkeypatch, 2, 1)
    other = hvd.elastic.ObjectState(commit_dir=tmp_path / "other", epoch=0)
    other.commit()
    assert not (tmp_path / "other").exists() and other.load_commit() is None


def test_a_failed_write_leaves_the_last_commit_whole(tmp_path, monkeypatch):
    state = hvd.elastic.ObjectState(commit_dir=tmp_path, epoch=1)
    state.commit()

    def torn(obj: object, f: object) -> None:
        f.write(b"half a commit")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(_commit.torch, "save", torn)
    state.epoch = 2
    with pytest.raises(OSError, match="disk full"):
        state.commit()
    monkeypatch.undo()
    assert _commit.read(tmp_path)["objects"] == {"epoch": 1}  # type: ignore[index]
    assert sorted(p.name for p in tmp_path.iterdir()) == [supervise.ELASTIC_FILE]


def test_the_folder_comes_from_the_argument_else_collsync_run_else_memory_only(tmp_path, monkeypatch):
    assert hvd.elastic.ObjectState(epoch=0).commit_path is None
    monkeypatch.setenv(supervise.ELASTIC_ENV, str(tmp_path / "env"))
    assert hvd.elastic.ObjectState(epoch=0).commit_path == tmp_path / "env" / supervise.ELASTIC_FILE
    given = hvd.elastic.ObjectState(commit_dir=tmp_path / "given", epoch=0)
    assert given.commit_path == tmp_path / "given" / supervise.ELASTIC_FILE


def test_a_commit_of_another_script_is_refused_naming_the_rank(tmp_path):
    hvd.elastic.ObjectState(commit_dir=tmp_path, epoch=0, loss=1.0).commit()
    with pytest.raises(ValueError, match=r"rank 0: the commit holds attribute\(s\) \['loss'\]"):
        hvd.elastic.ObjectState(commit_dir=tmp_path, epoch=0).load_commit()


# -- run -------------------------------------------------------------------------------------------------------


def test_run_resumes_from_the_commit_file_and_runs_the_reset_callbacks_first(tmp_path, capsys):
    first = hvd.elastic.ObjectState(commit_dir=tmp_path, epoch=0)
    first.epoch = 3
    first.commit()
    state = hvd.elastic.ObjectState(commit_dir=tmp_path, epoch=0)
    calls: list[str] = []
    state.register_reset_callbacks([lambda: calls.append(f"reset at epoch {state.epoch}")])

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState, until: int) -> int:
        calls.append(f"train from {state.epoch}")
        state.epoch = until
        return until

    assert train(state, 5) == 5
    assert calls == ["reset at epoch 3", "train from 3"]
    assert "rank 0: resumed from commit 1 (written on 1 rank(s), now 1)" in capsys.readouterr().err


def test_run_restores_and_calls_again_after_an_internal_error_and_gives_up_after_the_limit():
    state = hvd.elastic.ObjectState(epoch=0)
    state.commit()
    seen: list[int] = []
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(1)])

    @hvd.elastic.run
    def flaky(state: hvd.elastic.ObjectState) -> str:
        seen.append(state.epoch)
        state.epoch += 1
        if len(seen) < 3:
            raise hvd.HorovodInternalError("the ranks disagree")
        return "done"

    assert flaky(state) == "done" and seen == [0, 0, 0] and len(resets) == 2

    @hvd.elastic.run
    def broken(state: hvd.elastic.ObjectState) -> None:
        raise hvd.HorovodInternalError("always")

    with pytest.raises(RuntimeError, match=r"rank 0: broken was reset 3 times in this job and failed again"):
        broken(state)
    with pytest.raises(TypeError, match="must be an hvd.elastic.State"):
        broken(object())


def test_a_hosts_updated_interrupt_resets_without_a_restore():
    state = hvd.elastic.ObjectState(epoch=0)
    state.commit()
    seen: list[int] = []

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> None:
        seen.append(state.epoch)
        state.epoch += 1
        if len(seen) == 1:
            raise hvd.HostsUpdatedInterrupt(skip_sync=True)

    train(state)
    assert seen == [0, 1]


# -- collsync-run ------------------------------------------------------------------------------------------------


def test_collsync_run_gives_a_script_a_commit_folder_and_restarts_it_from_its_last_commit(tmp_path):
    goal = supervise.target(["python", "-m", "mpi4py", "train.py"], str(tmp_path))
    assert goal.run_dir is None and goal.env is not None and goal.env[supervise.ELASTIC_ENV] == str(tmp_path)
    assert goal.restart() == (goal.command, False, "the start (no hvd.elastic commit yet)")
    (tmp_path / supervise.ELASTIC_FILE).write_bytes(b"")
    args, resumes, start = goal.restart()
    assert args == goal.command and resumes and start.startswith("its last hvd.elastic commit")
    named = supervise.target(["python", "train.py"])
    assert named.elastic_dir is not None and "outputs/elastic/" in str(named.elastic_dir)
    with pytest.raises(ValueError, match="--elastic-dir is for scripts"):
        supervise.target(["collsync-train", "sync=bsp"], str(tmp_path))


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--host-discovery-script", "d.sh"], "--host-discovery-script (horovodrun's elastic growth) is not supported"),
        (["--max-np", "8"], "--max-np 8 above -n 4 (horovodrun's elastic growth) is not supported"),
    ],
)
def test_growing_the_world_is_refused_in_one_line(flags, says, capsys):
    with pytest.raises(SystemExit):
        supervise.parse(["-n", "4", *flags, "--", "python", "train.py"])
    assert says in capsys.readouterr().err
    assert supervise.parse(["-n", "4", "--max-np", "4", "--", "python", "train.py"]).np == 4
    assert os.environ.get(supervise.ELASTIC_ENV) is None


def test_the_commit_file_name_is_shared_with_the_library() -> None:
    assert Path(_commit.ELASTIC_FILE).name == supervise.ELASTIC_FILE
