"""The restart supervisor's decisions (collsync/supervise.py: what a lost rank leaves -> how many ranks next) and
the resume side of a restart on fewer workers (`runs.resume.refit`); no MPI needed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from collsync.checks import check_trace
from collsync.policy import bsp
from collsync.rules import sgd
from collsync.runs.resume import refit
from collsync.server import Server
from collsync.supervise import (
    FORWARDED,
    Outcome,
    _from_steps,
    decide,
    launch_command,
    lost_ranks,
    main,
    observe,
    parse,
    resumed,
    run_dir_of,
    supervise,
)
from collsync.trace import Trace
from collsync.types import Arrival


def outcome(code: int = 2, *, lost: set[int] = frozenset(), died: bool = False, **kw) -> Outcome:
    fields = {"finished": False, "stopped": False, **kw}
    return Outcome(code, fields["finished"], frozenset(lost), died or bool(lost), fields["stopped"])


# -- decide ---------------------------------------------------------------------------------------------------


def test_ranks_named_lost_are_taken_off_the_next_attempt() -> None:
    d = decide(outcome(lost={2, 5}), ranks=8, min_ranks=1, restarts_left=2)
    assert d.restart and d.ranks == 6 and "2, 5" in d.why


def test_a_rank_that_died_unnamed_counts_as_one() -> None:
    d = decide(outcome(code=9, died=True), ranks=4, min_ranks=1, restarts_left=1)
    assert d.restart and d.ranks == 3 and "not named" in d.why


@pytest.mark.parametrize(
    ("case", "says"),
    [
        (outcome(code=0), "finished"),
        (outcome(code=1, finished=True), "finished"),  # the launcher's status after a complete run folder
        (outcome(code=2), "without losing a rank"),  # a config error: the same again would fail the same way
        (outcome(code=143, stopped=True), "stopped by a signal"),  # a preemption is requeued, not restarted
    ],
    ids=["exit-0", "summary-complete", "config-error", "preempted"],
)
def test_no_restart_without_a_lost_rank(case: Outcome, says: str) -> None:
    d = decide(case, ranks=4, min_ranks=1, restarts_left=3)
    assert not d.restart and d.ranks == 4 and says in d.why


def test_a_lost_rank_restarts_even_if_the_others_were_signalled_to_stop() -> None:
    # srun and mpiexec may send the survivors SIGTERM after a rank died: they checkpoint, and the run goes on.
    d = decide(outcome(code=143, died=True, stopped=True), ranks=4, min_ranks=1, restarts_left=1)
    assert d.restart and d.ranks == 3


def test_never_below_min_ranks_nor_past_the_restarts() -> None:
    below = decide(outcome(lost={1, 2}), ranks=4, min_ranks=3, restarts_left=5)
    assert not below.restart and "--min-np=3" in below.why
    spent = decide(outcome(lost={1}), ranks=4, min_ranks=1, restarts_left=0)
    assert not spent.restart and "no restart left" in spent.why


# -- reading what a run left ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ranks"),
    [
        ("bsp: round 40 got no gradient within deadline=5s; waiting on worker 1 (rank 2 on node17)", {2}),
        ("start-up: rank(s) 2, 5-6 of 8 did not arrive within deadline=3s", {2, 5, 6}),
        ("rank 0 of 3 on vm: allreduce: rank 1 on vm did not arrive (stopped, hung or dead)", {1}),
        ("worker 1: no word from the server, rank 0 on node17, for 30s", {0}),
        ("mpirun noticed that process rank 3 with PID 77 on node n1 exited on signal 9 (Killed).", {3}),
        ("srun: error: node1: task 4: Killed", {4}),
        ("prterun noticed that process rank 2 with PID 31972 on node vm exited on\nsignal 9 (Killed).", {2}),
        (  # srun names the task that died, ends the step, then names the ones it ended itself
            "srun: error: vm: task 2: Killed\nsrun: launch/slurm: _step_signal: Terminating StepId=64.0\n"
            "slurmstepd-vm: error: *** STEP 64.0 ON vm CANCELLED AT 2026-11-25T21:04:03 ***\n"
            "srun: error: vm: task 0: Killed\n",
            {2},
        ),
        ("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES", set()),
        ("srun: error: vm: task 0: Exited with exit code 138", set()),  # rank 0 stopped by SIGUSR1, checkpointed
    ],
)
def test_lost_ranks_are_read_from_collsync_and_the_launchers(text: str, ranks: set[int]) -> None:
    assert lost_ranks(text) == ranks


def test_observe_reads_this_attempts_summary_only(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"incomplete": "waiting on worker 2 (rank 3 on n1)"}))
    old = time.time() - 100
    os.utime(summary, (old, old))
    assert observe(2, "", tmp_path, started=time.time()) == Outcome(2, False, frozenset(), False, False)
    now = observe(2, "", tmp_path, started=old - 1)
    assert now.lost == {3} and now.died and not now.finished
    summary.write_text(json.dumps({"updates": 10}))
    assert observe(1, "", tmp_path, started=old).finished
    killed = observe(9, "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n", tmp_path / "none", 0.0)
    assert killed.died and not killed.lost
    # srun failing to start the step is no lost rank: restarting on fewer would fail the same way.
    refused = observe(1, "srun: error: Unable to create step for job 12: More processors requested", tmp_path, 0.0)
    assert not refused.died


# -- the command of each attempt ------------------------------------------------------------------------------


def test_launch_commands() -> None:
    srun = launch_command("srun", 7, ["python", "-m", "collsync.cli"])
    assert srun == ["srun", "--mpi=pmi2", "--kill-on-bad-exit=1", "--ntasks=7", "python", "-m", "collsync.cli"]
    own = launch_command("srun --mpi=pmix -K0", 3, ["x"])
    assert own == ["srun", "--mpi=pmix", "-K0", "--ntasks=3", "x"]
    mpiexec = launch_command("mpiexec -disable-auto-cleanup", 3, ["x"])
    assert Path(mpiexec[0]).name == "mpiexec" and mpiexec[1:] == ["-disable-auto-cleanup", "-n", "3", "x"]


def test_the_run_folder_is_fixed_before_the_first_attempt(tmp_path: Path) -> None:
    given, folder = run_dir_of(["collsync-train", f"hydra.run.dir={tmp_path}"])
    assert folder == tmp_path and given == ["collsync-train", f"hydra.run.dir={tmp_path}"]
    added, folder = run_dir_of(["python", "-m", "mpi4py", "-m", "collsync.cli", "sync=bsp"])
    assert added[-1] == f"hydra.run.dir={folder}" and str(folder).startswith("outputs/")
    with pytest.raises(ValueError, match="multirun"):
        run_dir_of(["collsync-train", "-m", "sync=bsp,async"])
    with pytest.raises(ValueError, match="not a collsync-train run"):
        run_dir_of(["python", "my_horovod_script.py", "--epochs", "3"])


def test_a_restart_resumes_from_the_folders_checkpoint(tmp_path: Path) -> None:
    command = ["collsync-train", "resume=elsewhere", "steps=9"]
    assert resumed(command, tmp_path) == command  # nothing saved yet: start as the first attempt did
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert resumed(command, tmp_path) == ["collsync-train", "steps=9", "resume=auto"]


def test_each_restart_is_matched_with_the_step_it_resumed_at(tmp_path: Path) -> None:
    # A requeued job resumed on all its tasks at 40 (a world event too), then two restarts: from 120, and afresh.
    events = [{"ev": "world", "version": 40}, {"ev": "apply", "version": 41}, {"ev": "world", "version": 120}]
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert _from_steps(tmp_path, [True, False]) == [120, 0]
    assert _from_steps(tmp_path / "none", [True]) == [None]


def test_arguments() -> None:
    ns = parse(["-n", "8", "--max-restarts", "2", "--min-np", "6", "--", "collsync-train", "sync=bsp"])
    assert (ns.np, ns.restarts, ns.min_np, ns.command) == (8, 2, 6, ["collsync-train", "sync=bsp"])
    with pytest.raises(SystemExit):
        parse(["-n", "4", "--min-np", "5", "--", "x"])


def test_a_signal_goes_to_the_job_and_ends_the_supervisor(tmp_path: Path) -> None:
    """The job (a stand-in launcher: a shell that exits 143 on SIGTERM, as a collsync run after its checkpoint) gets
    the supervisor's SIGTERM; the supervisor returns its status and does not restart it."""
    launcher = tmp_path / "launcher"
    starts = tmp_path / "starts"
    launcher.write_text(f"#!/bin/sh\necho x >> {starts}\ntrap 'exit 143' TERM\nwhile :; do sleep 0.05; done\n")
    launcher.chmod(0o755)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    timer: threading.Timer | None = None
    try:
        timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
        timer.start()
        code = supervise(str(launcher), 2, 1, 3, ["collsync-train", f"hydra.run.dir={tmp_path / 'run'}"])
    finally:
        if timer is not None:
            timer.cancel()
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert code == 143
    assert starts.read_text().count("x") == 1


# -- the resume side: a checkpoint of 3 workers goes on with 2 -------------------------------------------------


def test_refit_carries_the_server_over_to_fewer_workers() -> None:
    policy = bsp()
    trace = Trace(lambda: 0.0)
    server = Server(torch.zeros(3, dtype=torch.float64), sgd(lr=1.0), policy, 3, trace=trace)
    for version in range(4):  # four full rounds of 3 workers
        for w in range(3):
            server.accept(Arrival(w, version, torch.full((3,), float(w + 1), dtype=torch.float64), version))
    server.accept(Arrival(1, 4, torch.ones(3, dtype=torch.float64), 4))  # round 4 under way: one buffered
    saved = {"server": server.state_dict(), "events": list(trace.events), "config": {}}

    assert refit(saved, 3) is saved  # the same world: nothing to change
    fitted = refit(saved, 2)
    after = Server(torch.zeros(3, dtype=torch.float64), sgd(lr=1.0), policy, 2, trace=Trace(lambda: 0.0))
    after.load_state_dict(fitted["server"])
    assert after.version == 4 and torch.equal(after.params, server.params)
    assert after.pending == {} and after.received == [4, 4] and after.clocks == [3, 3]
    ends = [e["ev"] for e in fitted["events"][-2:]]
    assert ends == ["drop", "world"] and fitted["events"][-2]["reason"] == "restart"
    # The two new workers' round 4 is a full round of 2; the trace of both worlds passes the invariants.
    resumed_trace = Trace(lambda: 0.0)
    resumed_trace.resume(fitted["events"], shift_clock=False)
    after.trace = resumed_trace
    for w in range(2):
        after.accept(Arrival(w, 4, torch.ones(3, dtype=torch.float64), 4))
    assert after.version == 5
    counts = check_trace(resumed_trace, policy, 2)
    assert counts == {"pushed": 15, "applied": 14, "dropped": 1, "updates": 5}
    assert saved["server"]["pending"]  # the checkpoint itself is left as it was


def test_a_launcher_that_is_no_command_is_named_with_the_flag(tmp_path, capsys):
    """Issue 36: `--launcher foo` is one line naming the flag and the launchers it takes, not the OS's bare
    "[Errno 2] No such file or directory: 'foo'"."""
    previous = {s: signal.getsignal(s) for s in FORWARDED}
    try:
        with pytest.raises(SystemExit) as caught:
            main(["-n", "2", "--launcher", "foo -x", "--", "collsync-train", f"hydra.run.dir={tmp_path / 'run'}"])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert caught.value.code == 2
    assert capsys.readouterr().err == (
        "collsync-run: error: --launcher 'foo -x': 'foo' is no command here (not on PATH, not a file): give mpiexec "
        "(the venv's, the default), srun, or a path to one, with its own options\n"
    )
