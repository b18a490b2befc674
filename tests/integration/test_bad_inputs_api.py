"""collsync.torch's bad inputs under a real launch (issue 36, items 4 and 14): what a second `init()` does once a
parameter-server mode has reserved its servers, and a mode option of the wrong type on every worker.

The rest of the API's bad inputs need no launch and run in-process at any world size
(`tests/mpi/test_torch_bad_inputs.py`); this one does, because a server mode's server ranks never return from the
first `init()`, so only a launch shows that the workers' second `init()` leaves them serving."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.hits import MPIEXEC

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="the venv has no mpiexec (install the mpich extra)")

GUARD_S = 120  # a guard against a hang only: the launch takes seconds

SCRIPT = """
import traceback

import torch

import collsync.torch as hvd

hvd.init(sync="async")  # rank 0 serves inside it; rank 1 is worker 0
hvd.init()  # none: a no-op, as under Horovod
hvd.init(sync="async")  # the same again: a no-op
for again in ({"sync": "bsp"}, {"servers": 0}):
    try:
        hvd.init(**again)
    except ValueError as exc:
        print(f"worker {hvd.rank()} refused: {exc}", flush=True)
model = torch.nn.Linear(2, 1)
try:
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sync="async", quorum="two")
except ValueError as exc:
    shown = "".join(traceback.format_exception(exc))
    print(f"worker {hvd.rank()} tracebacks={shown.count('Traceback')} chained={'During handling' in shown}: {exc}")
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
before = model.weight.detach().clone()
for _ in range(3):
    opt.zero_grad()
    model(torch.ones(4, 2)).sum().backward()
    opt.step()
print(f"worker {hvd.rank()} of {hvd.size()} servers={hvd.servers()} trained={not torch.equal(before, model.weight)}")
hvd.shutdown()
"""


def test_a_second_init_after_a_server_mode_keeps_it_and_refuses_another(tmp_path: Path) -> None:
    """Items 4 and 14: `init(sync="async")` then `init()` (or the same again) changes nothing and the workers train
    on the servers it reserved; `init(sync="bsp")` or `init(servers=0)` is refused on each worker naming both
    values (before: ignored, every rank stayed what the first call made it); a wrong-typed option of the mode is
    one traceback, not chained, with one line naming the mode, the option and the value (on every worker: the
    in-process tests check that at any world size)."""
    script = tmp_path / "again.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", str(script)],
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-4000:]
    for w in (0,):  # one worker beside the server: two processes, as many as CI has cores
        assert (
            f"worker {w} refused: collsync.torch.init: sync='bsp' differs from sync='async' of the first init(); "
            "the world is set up once: pass the same options, or none, to a second init()"
        ) in out, out
        assert f"worker {w} refused: collsync.torch.init: servers=0 differs from servers=1 of the first init()" in out
        assert f"worker {w} tracebacks=1 chained=False: sync=async: quorum='two' is not a whole number" in out, out
        assert f"worker {w} of 1 servers=1 trained=True" in out, out
    assert out.count("refused:") == 2 and "Traceback" not in proc.stderr, (out + proc.stderr)[-4000:]
