"""The layout's promises as tests: the algorithm core loads no MPI, Hydra or matplotlib (in a fresh interpreter, and
in its source, lazy imports included), and collsync's modules import one another without a cycle."""

from __future__ import annotations

import ast
import graphlib
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import collsync

PACKAGE = Path(collsync.__file__).parent
CORE = ["types", "rules", "policy", "specsync", "server", "loops", "sim", "checks"]
# What the core must never load: the MPI bindings, the config framework and the plotting library.
FORBIDDEN = ("mpi4py", "hydra", "matplotlib")


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, not `.__init__`)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts).removesuffix(".__init__")] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of nodes under `if TYPE_CHECKING:`: imported for annotations only, never at run time."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def imported(path: Path, known: Sequence[str] = (), annotations: bool = False) -> Iterator[str]:
    """Every module `path` imports at run time, at its top or inside a function (`annotations`: those imported for
    annotations only, under `if TYPE_CHECKING:`, too). `from a.b import c` is a.b.c where that is one of the `known`
    modules, else a.b (c is a name defined in a.b)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = set() if annotations else _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module


def loaded_after(code: str) -> list[str]:
    """The modules in `sys.modules` after running `code` in a fresh interpreter."""
    code += "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_core_loads_no_mpi_hydra_or_matplotlib() -> None:
    loaded = loaded_after("".join(f"import collsync.{name}\n" for name in CORE))
    assert all(f"collsync.{name}" in loaded for name in CORE)  # the check below is not vacuous
    bad = [m for m in loaded if m.split(".")[0] in FORBIDDEN or m.startswith("collsync.runtime.mpi_")]
    assert bad == [], f"importing the algorithm core loads {bad}"


def test_algorithm_modules_never_import_mpi4py() -> None:
    names = modules()
    core = [n for n in names if n.removeprefix("collsync.").split(".")[0] in CORE]
    assert len(core) > len(CORE)  # rules/ is a package of several modules
    offenders = {n: sorted(m for m in imported(names[n]) if m.split(".")[0] == "mpi4py") for n in core}
    assert {n: m for n, m in offenders.items() if m} == {}


def import_graph(annotations: bool = False) -> dict[str, set[str]]:
    """collsync's modules and the collsync modules each one imports (at its top or inside a function; with
    `annotations`, for annotations only as well)."""
    names = modules()
    return {
        name: {m for m in imported(path, names, annotations) if m in names and m != name}
        for name, path in names.items()
    }


@pytest.mark.parametrize("annotations", [False, True], ids=["run-time", "with-annotation-imports"])
def test_import_graph_has_no_cycle(annotations: bool) -> None:
    """No circle of imports, not even one closed by an import for annotations only (a module that must name
    another's type without importing it types it by its shape, as `server_state.Server` does)."""
    graph = import_graph(annotations)
    assert graph["collsync.report"] >= {"collsync.metrics", "collsync.runfiles"}  # the graph sees real imports
    if annotations:
        assert "collsync.runtime.mpi_shards" in graph["collsync.rundir"]  # annotation-only imports are in
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        cycle = exc.args[1]
        raise AssertionError(f"import cycle: {' -> '.join(reversed(cycle))}") from None


def test_cycle_detection_sees_function_local_imports(tmp_path: Path) -> None:
    """The scan reads imports inside functions (and skips annotation-only ones), so a lazy import cannot hide a
    cycle."""
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from collsync.loops import Worker\n"
        "def f():\n    from collsync.server import Server\n    import mpi4py.MPI\n"
    )
    found = set(imported(module))
    assert {"collsync.server", "mpi4py.MPI"} <= found and "collsync.loops" not in found
    assert import_graph()["collsync.runfiles"] >= {"collsync.metrics"}


def test_the_digits_load_without_scikit_learn_or_scipy() -> None:
    """Every rank of every digits launch reads the data at start-up: `collsync.data.digits` reads the CSV inside
    scikit-learn's wheel (collsync/bundled.py) instead of importing scikit-learn, which imports SciPy (2.5 s)."""
    loaded = loaded_after("from collsync.data import digits\ndigits()")
    assert "collsync.bundled" in loaded  # the check below is not vacuous
    assert not [m for m in loaded if m.split(".")[0] in ("sklearn", "scipy")]


# What the transport (runtime/) may import from the rest of collsync: the plain data types and arithmetic below
# it, the one record of how a process ends, the launcher's notice that a rank died (keepalive: standard library
# only), one line to stderr in one write (say), and SpecSync's protocol it carries. Never the core's checkpoint,
# policy or backups modules, nor anything above (runs/, torch/, the trainer): it only moves tensors.
TRANSPORT_MAY_IMPORT = {"types", "flat", "trace", "ending", "keepalive", "margin", "specsync", "say"}


def test_the_transport_imports_only_what_lies_below_it() -> None:
    graph = import_graph()
    transport = [name for name in graph if name.startswith("collsync.runtime")]
    assert "collsync.runtime.mpi_world" in transport  # the check below is not vacuous
    assert graph["collsync.keepalive"] == set() == graph["collsync.say"]  # the bottom
    assert graph["collsync.ending"] - {"collsync.ending"} == {"collsync.say"}
    up = {
        name: sorted(d for d in graph[name] if not d.startswith("collsync.runtime"))
        for name in transport
        if any(
            d.removeprefix("collsync.") not in TRANSPORT_MAY_IMPORT
            for d in graph[name]
            if not d.startswith("collsync.runtime")
        )
    }
    assert up == {}, f"runtime/ reaches up: {up}"


def test_a_server_rank_of_a_script_loads_nothing_of_the_trainer() -> None:
    """`collsync.torch`'s server ranks serve through the shard engine (`collsync.serving`) that `collsync-train`
    extends: none of the trainer's modules (its run shapes, data, evaluation, run folder, config schema) loads."""
    loaded = loaded_after("import collsync.torch\nimport collsync.torch._serve\n")
    assert "collsync.serving" in loaded  # the check below is not vacuous
    trainer = ("collsync.runs", "collsync.data", "collsync.evaluate", "collsync.rundir", "collsync.schema")
    assert [m for m in loaded if m.startswith(trainer)] == []


def test_a_server_rank_serves_a_job_without_the_config_framework(tmp_path: Path) -> None:
    """Worker 0 binds the server's rule and penalty to their factories (Hydra's `_partial_`); a server rank unpickles
    the job and builds both with neither Hydra nor OmegaConf loaded."""
    job = tmp_path / "job.pt"
    code = f"""
import pickle, torch
from collsync.torch._serve import Job
from collsync.torch.config import factory, sync_config
from collsync.torch.server_rule import rule_for, server_penalty
config = sync_config("async", penalty="gap_aware")
opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
rule = rule_for(opt, config, 3)
job = Job(torch.zeros(4), config.policy, factory(rule), factory(server_penalty(config.penalty, rule)), 3)
open({str(job)!r}, "wb").write(pickle.dumps(job))
"""
    assert "hydra" in loaded_after(code)  # the worker side does build through it: the check below is not vacuous
    served = loaded_after(
        f"import pickle\nfrom collsync.torch._serve import server_parts\n"
        f"penalty, rule = server_parts(pickle.loads(open({str(job)!r}, 'rb').read()))\n"
        "assert penalty is not None and rule is not None\n"
    )
    assert "collsync.rules.dana" in served  # async's momentum SGD is DANA on the server (server_momentum)
    assert [m for m in served if m.split(".")[0] in ("hydra", "omegaconf")] == []
