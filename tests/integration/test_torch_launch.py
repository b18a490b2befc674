"""collsync.torch scripts launched for real with the venv's mpiexec: against Horovod, against collsync-train, and
the example in every sync mode."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="the venv has no mpiexec (install the mpich extra)")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def mpirun(
    ranks: int, *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpi4py", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**ENV, **(env or {})})


def have_horovod() -> bool:
    """Horovod is optional for users; CI builds it (scripts/setup_horovod.sh), so there its absence fails."""
    if importlib.util.find_spec("horovod") is not None:
        return True
    if os.environ.get("CI"):
        pytest.fail("CI must build Horovod (bash scripts/setup_horovod.sh) before these tests")
    pytest.skip("Horovod is not built here (bash scripts/setup_horovod.sh)")


@pytest.fixture(scope="module")
def hvd_diff(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, list[torch.Tensor]]]:
    """tests/scripts/hvd_diff.py at `ranks` ranks with `args`: the final parameters of each case it ran. Each
    launch runs once per module (Horovod's at 4 ranks serves two tests)."""
    done: dict[tuple[int, tuple[str, ...]], dict[str, list[torch.Tensor]]] = {}

    def run(ranks: int, *args: str) -> dict[str, list[torch.Tensor]]:
        if (ranks, args) not in done:
            out = tmp_path_factory.mktemp("hvd_diff") / "out.pt"
            proc = mpirun(ranks, str(SCRIPTS / "hvd_diff.py"), *args, "--out", str(out))
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[ranks, args] = torch.load(out)
        return done[ranks, args]

    return run


@pytest.mark.parametrize("ranks", [2, 4])
def test_same_script_on_horovod_and_collsync_ends_equal(hvd_diff, ranks):
    """Plain, backward_passes_per_step=2, gradient_predivide_factor=2, fp16 compression and op=Sum: float64
    parameters after 20 steps equal within 1e-10 (in practice bit for bit)."""
    have_horovod()
    theirs = hvd_diff(ranks, "--impl", "horovod", "--case", "all")
    ours = hvd_diff(ranks, "--impl", "collsync", "--case", "all")
    assert sorted(ours) == sorted(theirs) == sorted(["plain", "passes", "predivide", "fp16", "sum"])
    for case in ours:
        assert all(p.dtype == torch.float64 for p in ours[case])
        worst = max((a - b).abs().max().item() for a, b in zip(theirs[case], ours[case], strict=True))
        assert worst <= 1e-10, f"{case} at -n {ranks}: parameters differ by {worst}"
    # The cases differ from each other, so each one really changed what was computed.
    assert not torch.equal(ours["plain"][0], ours["fp16"][0]) and not torch.equal(ours["plain"][0], ours["sum"][0])


def test_horovod_backend_reduces_like_horovod(hvd_diff):
    """fp16 compression through collsync.torch with backend="horovod", against Horovod's own run at 4 ranks (the
    launch test_same_script_on_horovod_and_collsync_ends_equal compares with)."""
    have_horovod()
    a = hvd_diff(4, "--impl", "horovod", "--case", "all")["fp16"]
    b = hvd_diff(4, "--impl", "collsync", "--backend", "horovod", "--case", "fp16")["fp16"]
    assert max((x - y).abs().max().item() for x, y in zip(a, b, strict=True)) <= 1e-10


EQUAL = {
    # DANA, async's default, has workers read a look-ahead, not theta: the plain rule compares the two.
    "async-1-worker": (2, ["sync=async", "optimizer=momentum"]),
    "ssp-s0": (3, ["sync=ssp", "sync.max_lead=0"]),
    "bsp-on-server": (3, ["sync=bsp"]),
    "backup-b0": (3, ["sync=backup", "sync.backups=0"]),
    "bsp-two-shards": (4, ["sync=bsp", "runtime.servers=2"]),
}
EQUAL_COMMON = ["runtime=mpi", "steps=20", "stragglers=none"]


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The `collsync-train` side of EQUAL: the cases of one rank count in one launch (tests/scripts/train_runs.py,
    the entry point's own `execute`), launched on the first case that asks; returns the case's run folder."""
    done: dict[int, Path] = {}

    def folder(case: str) -> Path:
        ranks = EQUAL[case][0]
        if ranks not in done:
            tmp = tmp_path_factory.mktemp(f"train_{ranks}")
            runs = {str(tmp / c / "run"): [*EQUAL_COMMON, *o] for c, (n, o) in EQUAL.items() if n == ranks}
            (tmp / "runs.json").write_text(json.dumps(runs))
            proc = mpirun(ranks, str(SCRIPTS / "train_runs.py"), str(tmp / "runs.json"))
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[ranks] = tmp
        return done[ranks] / case / "run"

    return folder


@pytest.mark.parametrize("case", list(EQUAL))
def test_script_through_collsync_torch_equals_collsync_train(tmp_path, train_runs, case):
    ranks, overrides = EQUAL[case]
    run = train_runs(case)
    proc = mpirun(ranks, str(SCRIPTS / "train_equal.py"), "--out", str(tmp_path / "t.pt"), *EQUAL_COMMON, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = torch.load(tmp_path / "t.pt")
    theirs = torch.load(run / "params.pt", weights_only=False)["params"]
    assert torch.equal(ours, theirs), f"max difference {(ours - theirs).abs().max().item()}"


def accuracy(stdout: str) -> float:
    found = re.findall(r"test accuracy: ([0-9.]+)", stdout)
    assert found, stdout[-2000:]
    return float(found[-1])


@pytest.fixture(scope="module")
def horovod_style() -> Callable[[str], str]:
    """The example as a Horovod script plus `init(sync=...)`: lr x size() and momentum 0.9 in every mode (the
    servers rescale the lr, server_rule.server_lr), 4 ranks, 8 epochs; each mode's output, run once (the every-mode test
    and the one-keyword comparison share these launches)."""
    runs: dict[str, str] = {}

    def run(sync: str) -> str:
        if sync not in runs:
            proc = mpirun(4, "examples/mnist.py", "--sync", sync, "--momentum", "0.9", "--epochs", "8")
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[sync] = proc.stdout
        return runs[sync]

    return run


@pytest.mark.serial
@pytest.mark.parametrize("sync", ["bsp", "backup", "async", "psp", "ssp", "specsync"])
def test_example_trains_digits_in_every_mode(horovod_style, sync):
    stdout = horovod_style(sync)
    assert accuracy(stdout) >= 0.90
    workers = 4 if sync in ("bsp", "backup") else 3  # rank 0 serves in the parameter-server modes
    assert f"({workers} workers, sync={sync})" in stdout


@pytest.mark.serial
@pytest.mark.parametrize("sync", ["async", "psp", "backup", "ssp", "specsync"])
def test_horovod_script_with_one_keyword_trains_as_bsp(horovod_style, sync):
    """Issue 24: Horovod's lr x size() and momentum 0.9 left in, async and specsync (one gradient an update: DANA,
    server_rule.server_momentum; async with the Gap in rounds, server_rule.penalty_for), ssp (rounds up to 1 stale:
    the look-ahead momentum), psp and backup train as bsp does.

    Without the servers' lr rule async ended 25 points below bsp (0.69-0.71). One run of each is compared, and one
    async run's final accuracy varies with the arrival order by more than a point: the bound here is 3 points; the
    issue's 1-point target needs the median of several runs (benchmarks/horovod_stragglers.py)."""
    mode, bsp = accuracy(horovod_style(sync)), accuracy(horovod_style("bsp"))
    assert mode >= bsp - 0.03, (sync, mode, bsp)


def test_example_trains_async_with_torchs_own_sampler():
    """`--sampler torch`: torch's DistributedSampler under collsync too (fixed shards: a Horovod script with only its
    import line changed), which async's workers finish each at their own pace."""
    proc = mpirun(4, "examples/mnist.py", "--sync", "async", "--sampler", "torch", "--epochs", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert accuracy(proc.stdout) >= 0.90
    assert "(3 workers, sync=async)" in proc.stdout


def test_options_beside_inits_mode_merge_and_contradictions_are_refused():
    proc = mpirun(3, str(SCRIPTS / "torch_options.py"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Up to "chose": the launcher may deliver one rank's line and its newline apart, with the other's in between.
    lines = re.findall(r"worker \d: async version (\d+) refused: (.*?chose)", proc.stdout)
    assert len(lines) == 2, proc.stdout
    assert all(int(version) >= 5 for version, _ in lines)  # both workers' gradients applied (5 each, 10 in all)
    assert {why for _, why in lines} == {
        "sync=async: quorum=2 conflicts with quorum=1 of the mode init(sync=...) chose"
    }


@pytest.mark.serial
@pytest.mark.parametrize("ranks", [4, 5])
def test_psp_with_a_partial_push_ends_a_script_whose_fast_workers_wait_in_an_allreduce(ranks):
    """Issue 33: psp with c = n - 1 of n workers, torch's fixed shards and a slow last worker left out of the rounds.
    Before, the others finished their epoch's batches and waited in the script's allreduce while the slow worker
    waited for rounds of c pushes only it sent: the job hung until the deadline (600 s by default, kept here). Now
    those workers are away and its rounds take its gradient alone (`Server.pushing`): every worker steps through
    its whole shard and each epoch's allreduce comes. The launch's limit only turns a hang into a failure."""
    proc = mpirun(ranks, str(SCRIPTS / "torch_psp_end.py"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    workers = ranks - 1
    # The launcher may deliver two ranks' lines run together: matched anywhere, not line by line.
    lines = re.findall(r"worker (\d): (\d+) steps, allreduced \[(\d+), (\d+)\], finished (True|False)", proc.stdout)
    assert sorted(int(w) for w, *_ in lines) == list(range(workers)), proc.stdout
    # 6 batches an epoch each: every worker's whole shard stepped (none skipped as finished), both epochs summed.
    assert {(int(n), int(a), int(b), f) for _, n, a, b, f in lines} == {(12, 6 * workers, 12 * workers, "False")}


def test_example_runs_on_horovod_by_its_import_line(tmp_path):
    have_horovod()
    source = (ROOT / "examples" / "mnist.py").read_text()
    line = "import collsync.torch as hvd  # was: import horovod.torch as hvd"
    assert line in source
    script = tmp_path / "mnist_horovod.py"
    script.write_text(source.replace(line, "import horovod.torch as hvd"))
    proc = mpirun(4, str(script), "--epochs", "10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert accuracy(proc.stdout) >= 0.90


# Fashion-MNIST at tiny size (CI installs Debian's dataset-fashion-mnist: scripts/setup.sh): 2,000 training and
# 2,000 test images, two epochs, 2 ranks: the MLP reached 0.745 here (bsp, seed 0: the same under Horovod), in 7 s.
# Where the package is missing the example exits with one line that says how to install it.
FASHION_TINY = ["--data", "fashion", "--limit", "2000", "--epochs", "2"]


def test_example_trains_fashion_mnist_at_tiny_size(tmp_path):
    proc = mpirun(2, "examples/mnist.py", *FASHION_TINY, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert accuracy(proc.stdout) >= 0.65
    assert "(2 workers, sync=bsp)" in proc.stdout
    assert len(list((tmp_path / "collsync").glob("*.json"))) == 4  # both ranks read the one cache


def test_example_trains_fashion_mnist_on_horovod_too(tmp_path):
    """--data fashion and --limit under the import line switched to Horovod: the same first rows on every rank."""
    have_horovod()
    source = (ROOT / "examples" / "mnist.py").read_text()
    script = tmp_path / "mnist_horovod.py"
    script.write_text(source.replace("import collsync.torch as hvd", "import horovod.torch as hvd"))
    proc = mpirun(2, str(script), *FASHION_TINY, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert accuracy(proc.stdout) >= 0.65


def test_example_says_how_to_install_fashion_mnist_where_it_is_missing(tmp_path):
    proc = mpirun(1, "examples/mnist.py", "--data", "fashion", "--mnist", str(tmp_path / "none"), timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "dataset-fashion-mnist" in line]
    assert lines and "apt-get install dataset-fashion-mnist" in lines[0] and "Traceback" not in proc.stderr


def test_example_refuses_an_ssp_option_without_ssp():
    """`--stream` chooses how an ssp worker reads; under another mode it would be silently ignored: refused instead."""
    proc = mpirun(1, "examples/mnist.py", "--sync", "bsp", "--stream", "off", timeout=120)
    assert proc.returncode != 0 and "--stream off: only with --sync ssp (not --sync bsp)" in proc.stderr


def test_synthetic_benchmark_prints_images_per_second():
    proc = mpirun(2, "examples/synthetic_benchmark.py", "--num-iters", "2", "--num-batches-per-iter", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"Img/sec per CPU: [0-9.]+ \+-[0-9.]+", proc.stdout), proc.stdout
    assert re.search(r"Total img/sec on 2 CPU\(s\): [0-9.]+", proc.stdout), proc.stdout


def test_vs_peers_benchmark_runs_at_tiny_size(tmp_path):
    out = tmp_path / "vs_peers.json"
    proc = mpirun(2, "benchmarks/vs_peers.py", "--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    sides = set(result["sizes"]["tiny"]["ms_per_step"])
    assert {"loop", "collsync", "backup", "ddp"} <= sides
    assert ("horovod" in sides) == result["horovod"]


def _idx(path: Path, array) -> None:
    import numpy as np

    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 8, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes()
    path.write_bytes(header + array.tobytes())


def test_example_reads_mnist_idx_files(tmp_path):
    """The example's --mnist path, on a tiny MNIST-shaped folder: two classes told apart by which half is bright."""
    import numpy as np

    rng = np.random.default_rng(0)

    def images(labels):
        x = rng.integers(0, 60, (len(labels), 28, 28))
        for i, label in enumerate(labels):
            half = slice(0, 14) if label == 0 else slice(14, 28)  # 0: top-left bright, 1: bottom-right
            x[i, half, half] += 180
        return x

    train, test = rng.integers(0, 2, 256), rng.integers(0, 2, 64)
    _idx(tmp_path / "train-images-idx3-ubyte", images(train))
    _idx(tmp_path / "train-labels-idx1-ubyte", train)
    _idx(tmp_path / "t10k-images-idx3-ubyte", images(test))
    _idx(tmp_path / "t10k-labels-idx1-ubyte", test)
    proc = mpirun(2, "examples/mnist.py", "--mnist", str(tmp_path), "--epochs", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert accuracy(proc.stdout) >= 0.90


@pytest.mark.parametrize("sync", ["async", "ssp", "bsp"])
def test_server_state_saves_and_resumes(tmp_path, sync):
    """Server modes: worker 0 saves server_state_dict() with torch.save; a new launch passes it back as
    server_state=, every worker's model starts from the saved server parameters (checked in the script) and the
    servers' version goes on from the saved one. bsp: one worker leaving ends training while worker 0 still asks."""
    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    proc = mpirun(3, str(SCRIPTS / "torch_resume.py"), "--sync", sync, "--out", str(first))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = mpirun(3, str(SCRIPTS / "torch_resume.py"), "--sync", sync, "--resume", str(first), "--out", str(second))
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = torch.load(first, weights_only=True)["shards"][0]
    after = torch.load(second, weights_only=True)["shards"][0]
    assert after["version"] > before["version"] > 0
    assert not torch.equal(after["params"], before["params"])


def test_server_state_refuses_what_does_not_fit():
    from collsync.torch.optimizer import _shard_states

    saved = {"format": 1, "sync": "async", "shards": [{}]}
    assert _shard_states(saved, 1, "async") == [{}]
    with pytest.raises(ValueError, match=r"saved from 1 server\(s\), this world has 2"):
        _shard_states(saved, 2, "async")
    with pytest.raises(ValueError, match="saved under sync='async', resumed under sync='ssp'"):
        _shard_states(saved, 1, "ssp")
    with pytest.raises(ValueError, match="not what DistributedOptimizer.server_state_dict"):
        _shard_states({"params": 1}, 1, "async")
