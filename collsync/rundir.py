"""The run folder on disk: checked before training, written in one place after it, and never the only place the
trained parameters could go.

`write_run(...)` writes a run's folder (trace.jsonl, params.pt, summary.json, report and plots) and logs its
summary; every run shape ends there, `save_incomplete(...)` too (a run cut short by a deadline or a signal).

`probe(out_dir)` writes, syncs and removes a small file, so that a folder that cannot take the results (read-only,
full, under a regular file) stops the run before the first gradient. `keep_on_write_failure(out_dir, payload)`
wraps the writes at the end of training: if one fails (the disk filled up meanwhile, the file system went away),
the parameters are saved to a temporary file instead and the error names both the folder and that file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from collsync.checks import check_trace
from collsync.metrics import format_summary, summary
from collsync.policy import SyncPolicy
from collsync.runfiles import write_report
from collsync.server import Server
from collsync.trace import Trace

if TYPE_CHECKING:
    from collsync.runtime.mpi_shards import Shards

# Bytes the probe writes: a few pages, so a folder with less room than a small model's parameters fails it.
PROBE_BYTES = 65536


class RunFolderError(OSError):
    """The run folder cannot be written; the message is one line naming the folder, the OS error and, at the end of
    training, where the parameters were kept."""

    def __str__(self) -> str:
        return str(self.args[0])


def describe(exc: OSError) -> str:
    """An OS error as one line naming its path: "'/data/run/x': [Errno 28] No space left on device"."""
    where = f"{exc.filename!r}: " if exc.filename is not None else ""
    return f"{where}[Errno {exc.errno}] {exc.strerror or exc}"


def probe(out_dir: Path) -> None:
    """Create the run folder if needed and write `PROBE_BYTES` to a temporary file in it (flushed to disk with
    fsync, then removed); raise RunFolderError naming the folder if any of that fails."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-probe-") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise RunFolderError(f"the run folder {str(out_dir)!r} cannot be written: {describe(exc)}") from exc


def finished(out_dir: Path, resume: str | None, steps: int) -> dict[str, Any] | None:
    """With `resume=auto`, the summary of a run folder that already holds a finished run of at least `steps`
    updates (summary.json without `incomplete`), else None: a requeued or repeated command would otherwise go on
    from the last periodic checkpoint, older than the end, and train the finished run again over its own folder.
    With more `steps` the run goes on from that checkpoint; where the folder has none, starting afresh would
    overwrite the finished run, which is refused."""
    if resume != "auto":
        return None
    try:
        done = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(done, dict) or done.get("incomplete") or not isinstance(done.get("updates"), int):
        return None
    if done["updates"] >= steps:
        return done
    if not (out_dir / "checkpoint.pt").exists():  # checkpoint.NAME; a fresh start would overwrite the finished run
        raise ValueError(
            f"resume=auto: run folder {out_dir} holds a finished run of {done['updates']} updates and no checkpoint "
            f"to go on from, so steps={steps} would start afresh over it: give it a new hydra.run.dir= (a run "
            f"with checkpoint.every= set can later go on from its last checkpoint)"
        )
    return None


def keep(payload: dict[str, Any]) -> Path:
    """Save `payload` (torch.save) to a new file in the temporary folder, else in the home folder; its path."""
    errors = []
    for folder in (Path(tempfile.gettempdir()), Path.home()):
        try:
            fd, name = tempfile.mkstemp(prefix="collsync-params-", suffix=".pt", dir=folder)
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            return Path(name)
        except OSError as exc:
            errors.append(describe(exc))
    raise OSError(f"no folder could take them ({'; '.join(errors)})")


@contextlib.contextmanager
def keep_on_write_failure(out_dir: Path, payload: dict[str, Any]) -> Iterator[None]:
    """Writes to the run folder at the end of training: on an OSError, `keep(payload)` elsewhere and raise
    RunFolderError naming the folder, the error and the file that holds the parameters now."""
    try:
        yield
    except OSError as exc:
        failed = f"the run folder {str(out_dir)!r} could not be written at the end of training ({describe(exc)})"
        try:
            kept = keep(payload)
        except OSError as lost:
            raise RunFolderError(f"{failed}, and the parameters could not be kept elsewhere: {lost}") from exc
        raise RunFolderError(f"{failed}; the parameters are kept in {kept}") from exc


def write_run(
    out_dir: Path,
    trace: Trace,
    policy: SyncPolicy,
    server: Server,
    config: dict[str, Any],
    *,
    params: torch.Tensor | None = None,
    ema: torch.Tensor | None = None,
    extra: dict[str, Any] | None = None,
    up_to_all: bool = False,
) -> dict[str, Any]:
    """Check the trace, write the run folder (trace, parameters, report) and log the summary; return it.
    `params` / `ema` are the whole model's when the server held one shard of them; `extra` goes into summary.json;
    `up_to_all`: a round may take every gradient (`checks.check_trace`).
    (`incomplete`: why a run was cut short)."""
    counts: dict[str, Any]
    try:
        counts = dict(check_trace(trace, policy, server.workers, up_to_all))
    except (AssertionError, ValueError) as exc:
        if not (extra or {}).get("incomplete"):
            raise
        counts = {"error": str(exc)}  # a run cut short may leave gradients that were never applied or dropped
    if params is None:
        params, ema = server.params, server.ema
    saved = {"params": params, "ema": ema, "version": server.version, "config": config}
    extra = {"trace_checks": counts, **(extra or {})}
    with keep_on_write_failure(out_dir, saved):  # a disk that filled up meanwhile: the parameters go elsewhere
        out_dir.mkdir(parents=True, exist_ok=True)
        trace.write_jsonl(out_dir / "trace.jsonl")
        torch.save(saved, out_dir / "params.pt")
        write_report(trace, out_dir, extra=extra, plots=bool(config.get("plots", True)))
    result = {**summary(trace), **extra}
    # Through logging, line by line: under Hydra its handlers show each line on the console and keep it in the run
    # folder's collsync.log, so the log a run leaves (e.g. a Slurm job's) holds its summary and where it went.
    log = logging.getLogger("collsync.train")
    for line in format_summary(result).splitlines():
        log.info(line)
    log.info("run folder: %s", out_dir)
    if result.get("lost"):
        # Finished degraded, and still a success (exit 0): the summary's `lost` says who, for scripts to check.
        named = ", ".join(f"rank {x['rank']} on {x['host']}" for x in result["lost"])
        log.warning("finished without lost worker(s) %s (summary.json: lost)", named)
    return result


def save_incomplete(
    out_dir: Path,
    trace: Trace,
    policy: SyncPolicy,
    server: Server,
    config: dict[str, Any],
    message: str,
    *,
    shards: Shards | None = None,
    evaluate: Callable[[int, torch.Tensor, torch.Tensor | None], None] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Rank 0 after a deadline, a divergence or a signal: the run folder with what the servers hold, evaluated
    first (`evaluate(version, params, ema)`), the summary marked incomplete with the reason (and `extra`). With several
    `shards`, the other shards' blocks are taken as they last published them."""
    server.drain()
    params, ema = server.params, server.ema
    if shards is not None and shards.servers > 1:
        params = torch.empty(shards.bounds[-1][1], dtype=server.params.dtype)
        shards.snapshot(params)
        params[shards.block] = server.params
        ema = None
    if evaluate is not None:
        evaluate(server.version, params, ema)
    return write_run(
        out_dir, trace, policy, server, config, params=params, ema=ema, extra={**(extra or {}), "incomplete": message}
    )
