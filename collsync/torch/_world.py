"""The world as `collsync.torch` shows it to a training script: who the workers are, and which ranks serve.

With parameter-server modes M ranks of the MPI world serve the parameter shards (shard j on rank j of `World.world`,
as `runtime=mpi` does), spread round-robin over the hosts by default (`placement`, `collsync.runtime.placement`:
`world` then orders them first; on one host it is the launcher's world, ranks 0..M-1). They are reserved at
`init()`: a server rank never returns from `init()` (it serves until the workers leave, then exits with status 0),
so the user's script runs on workers only and every Horovod call (`rank()`, `size()`, collectives,
`broadcast_parameters`) is about the workers alone: `size()` is the number of workers, `rank()` is 0..size()-1.
Without servers, every rank is a worker, as under Horovod.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from collsync import ending, keepalive
from collsync.policy import DEADLINE
from collsync.runtime import startup
from collsync.runtime.mpi_coll import shutdown as leave_together
from collsync.runtime.mpi_world import (
    RankLost,
    check_world_size,
    hello,
    launcher_size,
    node_layout,
    set_threads,
)
from collsync.runtime.placement import DEFAULT as PLACEMENT
from collsync.runtime.placement import check_placement, named_rank, place
from collsync.torch import _stall
from collsync.torch.config import SyncConfig, sync_config

if TYPE_CHECKING:
    from mpi4py import MPI

_SERVERS_ENV = "COLLSYNC_SERVERS"


@dataclass
class World:
    """What `init()` set up. `comm` spans the workers (the script's world); `world` is all of MPI's ranks, the
    servers first (`placement`: the launcher's order, or the servers spread over the hosts put first)."""

    world: MPI.Intracomm
    comm: MPI.Intracomm
    servers: int
    local: Any
    cross: Any
    sync: SyncConfig | None
    backend: str
    cleanups: list[Any] = field(default_factory=list)
    joiner: Any = None  # a weak reference to the last DistributedOptimizer, whose join `join()` runs while it lives
    speculating: Any = None  # the live optimizer's SpecSync side (`speculative()` re-runs steps through it), if any
    # More ranks on this node than cores: a rank waiting in a blocking collective would spin on a core another rank
    # needs to compute, so waits poll a nonblocking operation with pauses instead.
    oversubscribed: bool = False
    role: str = "worker"
    serve: bool = True  # server ranks serve inside init() (False: the caller drives them, as collsync-train does)
    deadline: float | None = DEADLINE  # how long start-up and shutdown wait for a rank before naming it lost
    lost: list[Any] = field(default_factory=list)  # serverless ranks gone on without (backup): nobody waits for them
    # Inside `hvd.elastic.run`: a worker lost under ULFM raises HorovodInternalError from the step (the state rolls
    # back to its last commit) rather than the step being done again over the survivors.
    elastic: bool = False
    placement: str = PLACEMENT


_STATE: World | None = None


def state(what: str = "collsync.torch") -> World:
    """The initialised world, or a clear error naming the call made too early."""
    if _STATE is None:
        raise ValueError(f"{what}: collsync.torch is not initialised; call collsync.torch.init() first")
    return _STATE


def init(
    comm: Any = None,
    process_sets: Any = None,
    *,
    sync: Any = None,
    servers: int | None = None,
    backend: str | None = None,
    serve: bool = True,
    deadline: float | None = None,
    placement: str | None = None,
) -> None:
    """Initialise collsync (Horovod's `hvd.init()`), reserving parameter-server ranks when the sync mode needs them.

    Args:
        comm: an mpi4py communicator, or a list of ranks of COMM_WORLD, to run on (default COMM_WORLD).
        process_sets: Horovod process sets: not supported (NotImplementedError).
        sync: the default sync mode of `DistributedOptimizer` here (a name such as "async", a `SyncConfig` from
            `sync_config` or `from_config`, or a `SyncPolicy`). A server mode reserves its servers now.
        servers: this many ranks serve parameter shards (default: what `sync` says, else the environment
            variable COLLSYNC_SERVERS, else 0). With servers >= 1 every sync mode runs on the parameter server.
        placement: which ranks serve: "spread" (default: round-robin over the hosts, so that the shards' traffic
            does not all go through the first host; on one host, ranks 0..servers-1 as with "first") or "first"
            (ranks 0..servers-1 of the launcher's world). Errors still name ranks as the launcher numbers them.
        backend: "mpi" (default) or "horovod": what reduces gradients under full sync (bsp without servers).
        serve: False for a caller that runs the server ranks itself (`collsync-train`): they return from
            `init()` with `role() == "server"`, and `rank()` / `size()` count the servers there.
        deadline: seconds start-up and shutdown wait for every rank (default: the deadline of `sync`, else
            600; None: for ever). A rank that does not arrive in time is named in one line and the job ends.

    Raises:
        ValueError: bad values (the world too small for the servers, an unknown backend, a deadline not > 0), or
            a second call asking for another sync, servers, backend or deadline (the same again, or none: a no-op).
        TypeError: `servers` or `comm` of the wrong type.
        RankLost: a rank did not arrive within `deadline` (uncaught: one line, and the job is aborted).
        NotImplementedError: process sets.
    """
    global _STATE
    _check_args(comm, process_sets, servers, deadline)
    if placement is not None:
        check_placement(placement, "collsync.torch.init: placement")
    config = sync_config(sync) if sync is not None else None
    asked = {"sync": config, "servers": servers, "backend": backend, "deadline": deadline, "placement": placement}
    if deadline is None:
        deadline = config.policy.deadline if config is not None else DEADLINE
    startup.arm("collsync", deadline)  # MPI_Init (the import below) waits for every rank: bounded by the deadline
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    startup.mpi_up()
    if _STATE is not None:
        return _again(_STATE, asked)  # Horovod allows init() more than once
    world = _world_comm(MPI, comm)
    servers = _servers(servers, config, world.Get_size())
    backend = _backend(backend, config)
    _watch(world)
    hosts = hello(world, deadline)  # bounded: a rank that never arrives is named, not waited for (its host is kept)
    startup.disarm()
    placement = placement or PLACEMENT
    world = place(world, hosts, servers, placement)  # the servers first (the same `world` where nothing moves)
    _stall.configure(deadline)  # a collective some workers never call: named at 60 s, the job ended at the deadline
    node, cores = node_layout(world, deadline)  # collective over the whole world: servers included
    set_threads(world, node)
    over = node > cores  # oversubscribed
    rank = world.Get_rank()
    is_server = rank < servers
    comm_w = cast("MPI.Intracomm", world.Split(0 if not is_server else 1, rank))  # the stubs say Comm
    role = "server" if is_server else "worker"
    if is_server and serve:
        _serve(World(world, comm_w, servers, None, None, config, backend, oversubscribed=over, deadline=deadline))
    local = comm_w.Split_type(MPI.COMM_TYPE_SHARED, key=comm_w.Get_rank())
    cross = comm_w.Split(local.Get_rank(), comm_w.Get_rank())
    _STATE = World(
        world,
        comm_w,
        servers,
        local,
        cross,
        config,
        backend,
        oversubscribed=over,
        role=role,
        serve=serve,
        deadline=deadline,
        placement=placement,
    )
    if backend == "horovod" and role == "worker":
        from collsync.runtime.horovod import init as horovod_init  # lazily: Horovod is optional

        horovod_init(comm_w)
    ending.at_exit(shutdown)


def _check_args(comm: Any, process_sets: Any, servers: Any, deadline: Any) -> None:
    """`init`'s arguments, typed at the entry (before MPI starts): past it a string would fail inside a comparison
    or a timer's arithmetic, and a number given for `comm` inside MPI, with a message that names neither `init` nor
    the argument."""
    if process_sets is not None:
        raise NotImplementedError("collsync.torch.init: process sets are not supported (process_sets=...)")
    if not (comm is None or isinstance(comm, list | tuple) or callable(getattr(comm, "Split_type", None))):
        raise TypeError(
            f"collsync.torch.init: comm={comm!r} is not an mpi4py communicator; pass an MPI.Intracomm, a list of "
            "ranks of MPI.COMM_WORLD, or nothing (COMM_WORLD)"
        )
    if servers is not None and (isinstance(servers, bool) or not isinstance(servers, int)):
        raise TypeError(f"collsync.torch.init: servers={servers!r} is not a whole number; pass an int >= 0")
    if deadline is None:
        return
    if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not 0 < deadline < math.inf:
        raise ValueError(
            f"collsync.torch.init: deadline={deadline!r} must be a number of seconds > 0 (None: wait for ever)"
        )


def _watch(world: MPI.Comm) -> None:
    """What ends or warns this rank from outside its script: an exception that ends the script on one rank ends the
    job (the others would wait for it until the deadline); under collsync.keepalive, the launcher's notice that a
    rank died."""
    ending.watch_failures(world, _who, quiet=(RankLost,))
    keepalive.watch_notice()


def _serve(st: World) -> None:
    """A server rank: serve inside `init()`, never returning (the process exits once the workers left)."""
    global _STATE
    # Lazily: the server side (the shard engine, and the Hydra it builds rules with) loads on server ranks only.
    from collsync.torch._serve import serve_forever

    _STATE = st
    serve_forever(st.world, st.servers)


def _again(st: World, asked: dict[str, Any]) -> None:
    """A second `init()`: the same options again (or none) are fine, as under Horovod; another sync mode, servers,
    backend or deadline would be ignored silently (the world is made once), so it is refused naming both."""
    first = {"sync": st.sync or sync_config("bsp"), "servers": st.servers, "backend": st.backend}
    first["placement"] = st.placement
    for key, value in asked.items():
        was = first.get(key, st.deadline)
        if value is not None and value != was:
            raise ValueError(
                f"collsync.torch.init: {key}={_shown(value)} differs from {key}={_shown(was)} of the first init(); "
                "the world is set up once: pass the same options, or none, to a second init()"
            )


def _shown(value: Any) -> str:
    """An init() option as a script writes it: a sync mode by its name and the options it was given."""
    if not isinstance(value, SyncConfig):
        return repr(value)
    return repr(value.name) + (f" with {value.given}" if value.given else "")


def _world_comm(MPI: Any, comm: Any) -> Any:  # noqa: N803 - the module's own name
    """The communicator `init(comm=...)` runs on: COMM_WORLD, a communicator, or a group of COMM_WORLD's ranks."""
    world = MPI.COMM_WORLD if comm is None else comm
    if isinstance(world, (list, tuple)):
        group = MPI.COMM_WORLD.Get_group().Incl(list(world))
        world = MPI.COMM_WORLD.Create_group(group)
        if world == MPI.COMM_NULL:
            raise ValueError(f"collsync.torch.init: this rank is not in comm={list(comm)}")
    if comm is None:
        check_world_size(launcher_size(), world.Get_size())
    return world


def _backend(backend: str | None, config: SyncConfig | None) -> str:
    """`init`'s backend: the one given, else the sync mode's, else "mpi"."""
    backend = backend or (config.backend if config is not None else None) or "mpi"
    if backend not in ("mpi", "horovod"):
        raise ValueError(f"collsync.torch.init: backend={backend!r} must be 'mpi' or 'horovod'")
    return backend


def _servers(servers: int | None, config: SyncConfig | None, size: int) -> int:
    """How many ranks serve: `init(servers=...)`, else what the sync mode says, else COLLSYNC_SERVERS, else 0."""
    if servers is None:
        servers = config.servers if config is not None and config.servers else None
    if servers is None:
        env = os.environ.get(_SERVERS_ENV, "0")
        if not env.isdigit():
            raise ValueError(f"collsync.torch.init: {_SERVERS_ENV}={env!r} must be a whole number")
        servers = int(env)
    if servers < 0:
        raise ValueError(f"collsync.torch.init: servers={servers} must be >= 0")
    if servers and servers >= size:
        raise ValueError(
            f"collsync.torch.init: servers={servers} leave no worker in a world of {size} rank(s); launch at least "
            f"{servers + 1} ranks (mpiexec -n {servers + 1} ...)"
        )
    return servers


def shutdown() -> None:
    """Leave collsync (Horovod's `hvd.shutdown()`): optimizers say goodbye to their servers, windows are freed, the
    server ranks are told to exit. Collective over the workers; called at exit if the script does not."""
    global _STATE
    st = _STATE
    if st is None:
        return
    try:
        for close in reversed(st.cleanups):
            close()
        if not st.servers and not st.lost and not ending.leaving():
            # Serverless workers leave together, within the deadline: MPI_Finalize at exit would otherwise wait
            # for a lost rank for ever (a process leaving without it, `ending.leaving`, does not). Server modes'
            # workers leave at their own times; their servers see them go.
            leave_together(st.comm, st.deadline)
    except RankLost as exc:
        # A rank lost at the end: the world cannot be left in order (MPI_Finalize would wait for it too).
        fatal(exc)
    st.cleanups.clear()
    if st.servers and st.serve and st.role == "worker":
        from collsync.torch._serve import release_servers  # lazily, as in `init`: the server side's module

        release_servers(st.world, st.servers, st.comm.Get_rank())
    _STATE = None


def shrunk(old: Any, new: Any) -> None:
    """A serverless world that went on in place without a dead rank (ULFM: `runtime.mpi_ulfm`, a reducer's
    `on_shrink`): `size()`, `rank()`, the local and cross ranks, the collectives and the end follow the survivors'
    communicator `new` (collective over them); `world_rank()` stays the rank in the whole MPI world."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    st = _STATE
    if st is None or st.servers or old not in (st.comm, st.world):
        return
    st.comm = new
    st.local = new.Split_type(MPI.COMM_TYPE_SHARED, key=new.Get_rank())
    st.cross = new.Split(st.local.Get_rank(), new.Get_rank())


def fatal(exc: BaseException) -> None:
    """Report a lost rank in one line and end the job: `MPI_Abort`, not `os._exit`. Abort has the launcher end
    every rank, the stopped or hung one included; a rank that only exits leaves it, and under `srun` (which keeps
    a step's other tasks running by default) the job would wait for it until its time limit. Exit status 2; a
    rank other than 0 defers, as rank 0 reports the same loss and aborts the job meanwhile."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    defer = ending.REPORT_GRACE_S if MPI.COMM_WORLD.Get_rank() != 0 else 0.0
    ending.end(ending.DEADLINE, f"collsync: {exc}", comm=MPI.COMM_WORLD, defer=defer)


def _who() -> str:
    """How a failure line names this rank: `where()` once initialised, else its rank in the world."""
    if _STATE is None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        return f"rank {MPI.COMM_WORLD.Get_rank()} on {socket.gethostname()}"
    return where()


def is_initialized() -> bool:
    return _STATE is not None


def rank() -> int:
    """This worker's rank among the workers (0..size()-1); server ranks never run the script past `init()`
    (after `init(serve=False)`, a server's rank among the servers)."""
    return state("rank()").comm.Get_rank()


def size() -> int:
    """The number of workers (the ranks that run the script); the world less the server ranks."""
    return state("size()").comm.Get_size()


def local_rank() -> int:
    return state("local_rank()").local.Get_rank()


def local_size() -> int:
    return state("local_size()").local.Get_size()


def cross_rank() -> int:
    return state("cross_rank()").cross.Get_rank()


def cross_size() -> int:
    return state("cross_size()").cross.Get_size()


def role() -> str:
    """'worker' on every rank that runs the script; 'server' only after `init(serve=False)` on a server rank
    (with the default `serve=True` server ranks serve inside `init()` and never get here)."""
    return state("role()").role


def world_rank() -> int:
    """This rank in the whole MPI world (servers included): what `mpiexec` and error lines number it by (the
    launcher's rank, whatever the servers' placement)."""
    world = state("world_rank()").world
    return named_rank(world, world.Get_rank())


def servers() -> int:
    """How many ranks serve parameter shards (spread over the hosts by default: `init(placement=...)`)."""
    return state("servers()").servers


def where() -> str:
    """'worker 2 (rank 3 of 5 on node17)': the attribution collsync's errors start with."""
    st = state()
    rank = named_rank(st.world, st.world.Get_rank())
    return f"worker {st.comm.Get_rank()} (rank {rank} of {st.world.Get_size()} on {socket.gethostname()})"
