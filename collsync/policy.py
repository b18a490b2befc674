"""Sync policies: when a worker may start, how many gradients make an update, and what happens to late ones.

A policy is a frozen dataclass of plain values, validated where it is written. Two families share it:

* **rounds** (BSP, backup workers, SSP): gradients are tagged with the round (`clock`) they were computed for. Round
  t is applied once `quorum` gradients for it arrived; a gradient for a round already applied is dropped
  (000_... Alg. 3-4: "stale gradients dropped"). A worker may start round c once the server reached version
  c - max_lead: max_lead = 0 is BSP/backup, max_lead = s is SSP with bound s (004_... §II-C), so SSP with s = 0 is
  BSP by construction.
* **stream** (ASGD): every gradient is applied, in groups of `quorum` (1 for ASGD), whatever its version.

A `timeout` is a collection deadline (000_... §6, 003_... tau1). In a stream, it applies whatever arrived (at least
one gradient) `timeout` seconds after the first gradient of an update. In rounds, a round with a timeout waits for
*every* worker, but no longer than `timeout` seconds after its `quorum`-th gradient: PSP's partial push (at least c,
then up to tau1 more, or all n), and SSP with a timeout (quorum 1: a frozen worker cannot hold the others).

With parameter-server shards, `pull_fraction` and `pull_timeout` are PSP's partial pull (003_... Alg. 1, worker
lines 8-15): a worker starts once that fraction of the shards published the round it needs, then waits at most
`pull_timeout` seconds for the rest, computing on the blocks it already has for those that did not.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from collsync.deadline import DEADLINE as DEADLINE  # the default deadline (a module of its own: no torch)
from collsync.rules.fasgd import bfasgd_probability
from collsync.specsync import Speculation


@dataclass(frozen=True)
class Sent:
    """How the servers send a worker its parameters (`SyncPolicy.sent`, `runtime.mpi_sent`): `least` is the
    first version a worker that pushed round c may compute on (`SyncPolicy.least_version`; 0 under async, where a
    worker reads the newest version once its push was dealt with); `streams`: every publish
    goes to every worker and a worker reads the first version `least` allows without waiting for its own push to
    land (SSP: the version its next round needs was published before its push arrived, so push and pull cross
    instead of following each other); else each worker is sent the first version >= `least` once its push was
    dealt with. `ahead` (streaming): the most deliveries a worker is sent beyond those it had taken when it made its
    last push the server took (`runtime.mpi_sent.Outbox`: a small delivery completes at the server before the
    worker receives it, so without a bound a worker that stopped would be sent every version into MPI's buffers)."""

    least: Callable[[int], int]
    streams: bool
    ahead: int = 1


@dataclass(frozen=True)
class Transmit:
    """B-FASGD's bandwidth control (002_... §2.3, eq. 9): at each opportunity a worker pushes (fetches) iff

        r < 1 / (1 + c / (signal + eps)),   r uniform in [0, 1),   c = `c_push` (`c_fetch`)

    where `signal` is the scalar the server last published (`Stamp.signal`: FASGD's v). None never skips; c = 0
    always transmits. A skipped push makes the server re-apply the worker's last gradient, a skipped fetch keeps
    the worker on the parameters it has. One draw from the worker's own `rng` per decision with a c, none without.
    """

    c_push: float | None = None
    c_fetch: float | None = None

    def __post_init__(self) -> None:
        for key in ("c_push", "c_fetch"):
            value = getattr(self, key)
            if value is not None and not value >= 0:
                raise ValueError(f"bfasgd: {key}={value!r} must be >= 0")

    def push(self, rng: random.Random, signal: float) -> bool:
        """Push this gradient?"""
        return self.c_push is None or rng.random() < bfasgd_probability(signal, self.c_push)

    def fetch(self, rng: random.Random, signal: float) -> bool:
        """Fetch the parameters at this opportunity?"""
        return self.c_fetch is None or rng.random() < bfasgd_probability(signal, self.c_fetch)


def transmit(c_push: float | None, c_fetch: float | None) -> Transmit | None:
    """The `Transmit` of these probabilities' constants, or None when both are None (every push and fetch made)."""
    return None if c_push is None and c_fetch is None else Transmit(c_push, c_fetch)


def push_quorum(fraction: float, workers: int) -> int:
    """PSP's c from a fraction of the n workers: ceil(fraction x n), at least 1.

    003_... §2.3 and Alg. 1 (server lines 5-12) wait for "the first m <= k workers"; its setting, c = 28 of 32, is
    0.875 x 32 exactly, so the paper fixes no rounding. Rounding up (never fewer than the fraction says) makes c = n
    wherever fraction x n > n - 1 (0.875 of 4 to 7 workers: psp's rounds then wait for every push); `pushes` gives
    a partial push at small n. A round of c < n does not wait for workers that wait in another collective of
    their script (`SyncPolicy.partial_push`).
    """
    return max(1, math.ceil(fraction * workers - 1e-9))


@dataclass(frozen=True)
class SyncPolicy:
    """How workers and the server synchronise. Build one with `bsp`, `backup`, `asynchronous` or `ssp`."""

    name: str
    rounds: bool = True
    backups: int = 0
    quorum: int | None = None
    max_lead: int | None = 0
    timeout: float | None = None
    deadline: float | None = None
    transmit: Transmit | None = None  # B-FASGD (002_... eq. 9): workers push and fetch with a probability
    pull_fraction: float = 1.0
    pull_timeout: float | None = None
    push_fraction: float | None = None
    speculation: Speculation | None = None  # SpecSync (004_...): naive waiting, scheduler re-syncs and aborts
    on_lost: str | None = None  # a worker silent for `deadline`: "continue" without it or "stop"; None: `tolerates`
    stream: bool = False  # SSP: the servers stream every version and a worker need not wait for its push (`sent`)
    # Streaming: how long a worker that pushed round c holds out for the version that round makes, as a fraction of
    # the seconds its gradient took (`loops.Worker.ready`); None: not at all (the newest version its bound allows).
    patience: float | None = None
    # Streaming: and at least `usual` times the median wait that version took over the worker's last `USUAL_OF`
    # pushes (`loops.Worker.holds_out`); None: `patience` alone.
    usual: float | None = None

    def __post_init__(self) -> None:
        if self.stream and not (self.rounds and self.max_lead and self.speculation is None):
            raise ValueError(f"{self.name}: stream=True needs SSP's rounds with max_lead >= 1")
        if self.patience is not None and not (self.stream and self.patience >= 0):
            raise ValueError(f"{self.name}: patience={self.patience!r} must be >= 0, and only with stream=True")
        if self.usual is not None and not (self.patience is not None and self.usual >= 0):
            raise ValueError(f"{self.name}: usual={self.usual!r} must be >= 0, and only with a patience")
        if self.backups < 0:
            raise ValueError(f"{self.name}: backups={self.backups} must be >= 0")
        if self.quorum is not None and self.quorum < 1:
            raise ValueError(f"{self.name}: quorum={self.quorum} must be >= 1")
        if self.max_lead is not None and self.max_lead < 0:
            raise ValueError(f"{self.name}: max_lead={self.max_lead} must be >= 0")
        if not self.rounds and self.max_lead is not None:
            raise ValueError(f"{self.name}: a stream policy has no rounds to lead by; got max_lead={self.max_lead}")
        if self.rounds and self.max_lead is None:
            raise ValueError(f"{self.name}: a round policy needs max_lead >= 0")
        if self.rounds and self.max_lead and self.backups:
            raise ValueError(
                f"{self.name}: SSP (max_lead={self.max_lead}) cannot drop backups (backups={self.backups})"
            )
        for key in ("pull_fraction", "push_fraction"):
            value = getattr(self, key)
            if value is not None and not 0.0 < value <= 1.0:
                raise ValueError(f"{self.name}: {key}={value!r} must be in (0, 1]")
        if self.push_fraction is not None and (self.quorum is not None or self.backups):
            raise ValueError(f"{self.name}: push_fraction={self.push_fraction} and quorum/backups both set the quorum")
        for key in ("timeout", "deadline", "pull_timeout"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"{self.name}: {key}={value!r} must be > 0 seconds")
        if self.on_lost not in ON_LOST:
            raise ValueError(f"{self.name}: on_lost={self.on_lost!r} must be one of continue, stop (or null)")
        t = self.transmit
        if t is not None and self.rounds:
            raise ValueError(
                f"{self.name}: c_push={t.c_push}, c_fetch={t.c_fetch} (B-FASGD) needs an asynchronous policy "
                "(sync=bfasgd or sync=async)"
            )
        if self.speculation is not None and (t is not None or self.quorum not in (None, 1) or self.backups):
            raise ValueError(
                f"{self.name}: speculation runs over ASP (quorum 1) or SSP; got quorum={self.quorum}, "
                f"backups={self.backups}, transmit={t}"
            )
        # Timeouts are ordered: collecting (tau1) and pulling (tau2) give up on stragglers long before the deadline
        # that declares the run stuck.
        for key in ("timeout", "pull_timeout"):
            value = getattr(self, key)
            if value is not None and self.deadline is not None and not value < self.deadline:
                raise ValueError(f"{self.name}: {key}={value} must be < deadline={self.deadline}")

    def check(self, workers: int) -> None:
        """Fail before training when the policy cannot run with this many workers."""
        if workers < 1:
            raise ValueError(f"{self.name}: {workers=} must be >= 1")
        if self.backups >= workers:
            raise ValueError(f"{self.name}: backups={self.backups} must be < {workers=}")
        if self.quorum is not None and self.quorum > workers:
            raise ValueError(f"{self.name}: quorum={self.quorum} must be <= {workers=}")
        if self.quorum is not None and self.backups and self.quorum != workers - self.backups:
            raise ValueError(f"{self.name}: quorum={self.quorum} contradicts backups={self.backups} of {workers=}")

    def full_for(self, workers: int) -> int:
        """How many gradients an update takes at most (and at once): `quorum`, or every worker for a round with a
        collection timeout (which waits for all of them, up to the timeout after the `quorum`-th)."""
        return workers if self.rounds and self.timeout is not None else self.quorum_for(workers)

    @property
    def bandwidth_aware(self) -> bool:
        """Workers may skip pushes and fetches (B-FASGD's `transmit`): the server then keeps each worker's last
        gradient to re-apply, and the workers need its `Stamp.signal`."""
        return self.transmit is not None

    def quorum_for(self, workers: int) -> int:
        """The number of gradients one update averages (the divisor N of 000_... Alg. 4)."""
        if self.quorum is not None:
            return self.quorum
        if self.push_fraction is not None:
            return push_quorum(self.push_fraction, workers)
        return workers - self.backups if self.rounds else 1

    @property
    def partial_push(self) -> bool:
        """PSP's partial push (003_... Alg. 1, server lines 5-12): a round takes the first c gradients of whichever
        workers push, no worker in particular, so c counts only the workers still pushing: Q = min(c, n - lost - away)
        (`Server.pushing`), where `away` are the workers waiting in another collective of their script
        (`collsync.torch`). Not backup workers, BSP or SSP, whose rounds keep their quorum."""
        return self.name == "psp"

    def tolerates(self, lost: int, workers: int) -> bool:
        """May training go on with `lost` of `workers` workers lost (silent for `deadline`)? `on_lost=stop` never;
        `on_lost=continue`, or by default a policy that needs no particular worker, while one worker is left:

            stream (async, bfasgd, specsync):  n - lost >= 1
            backup workers (000_... Alg. 3-4): lost <= b    (the N = n - b gradients of a round still come)
            SSP, PSP (rounds with a bound or a partial push):  n - lost >= 1   (their quorum shrinks to the live)
            BSP: never by default (every worker, every round: a BSP run goes on through a restart instead)
        """
        if self.on_lost == "stop" or lost >= workers:
            return False
        if self.on_lost == "continue" or not self.rounds:
            return True
        if self.backups:
            return lost <= self.backups
        return bool(self.max_lead) or self.timeout is not None or self.quorum_for(workers) < workers

    def least_version(self, clock: int) -> int:
        """The first version on which a worker that pushed round `clock` may compute its next (`may_start`)."""
        return clock + 1 - (self.max_lead or 0) if self.rounds else 0

    def sent(self) -> Sent | None:
        """What the servers send a worker (`runtime.mpi_sent`), where a worker reads right after each push: the
        first version >= its `least_version` once its push was dealt with (read your own writes; under async the
        newest, one delivery a push, so no more traffic than its pull), or, where the policy lets a worker's next
        round start before its own push lands (SSP with `stream`), every version as it is published. None where
        workers pull from the window: B-FASGD (a skipped fetch leaves a push with no read after it) and SpecSync
        (a re-sync reads with no push before it).

        Async takes deliveries because the window's read is a seqlock: a worker whose Get and re-read take longer
        than the server takes between two publishes never reads a clean copy. With a worker behind a 5 ms link and
        three fast ones publishing every few ms, that worker made 1 step in 8 epochs (benchmarks/README.md, "Async
        with a slow host")."""
        if self.speculation is not None or self.transmit is not None:
            return None
        # SSP's bound s: while the server waits on a worker it publishes at most s + 1 versions past the one that
        # worker last pushed from (round c waits for its push; that push's version was >= c - s), so this many
        # deliveries ahead never hold back a worker the rounds wait on.
        lead = self.max_lead or 0
        return Sent(self.least_version, streams=self.stream, ahead=lead + 1)

    def may_start(self, clock: int, version: int) -> bool:
        """Whether a worker may compute the gradient of round `clock` on parameters at server `version`."""
        return not self.rounds or version >= clock - (self.max_lead or 0)

    def next_clock(self, clock: int, version: int) -> int:
        """The round a worker computes next, having finished `clock` and read `version`.

        A backup worker that fell behind skips to the server's round (its late gradient was dropped anyway).
        """
        return max(clock + 1, version) if self.rounds else version


# What `sync.on_lost` may say (None: the policy's default, see `SyncPolicy.tolerates`).
ON_LOST = (None, "continue", "stop")

# How many of a streaming worker's last pushes its usual wait for the fresh version is the median of (`usual`).
USUAL_OF = 16
USUAL_FROM = 4  # and from how many on (one wait of the first few is not yet what is usual)


def bsp(deadline: float | None = DEADLINE, on_lost: str | None = None) -> SyncPolicy:
    """Bulk-synchronous: every worker, every round; the mean of all n gradients."""
    return SyncPolicy("bsp", deadline=deadline, on_lost=on_lost)


def backup(backups: int = 1, deadline: float | None = DEADLINE, on_lost: str | None = None) -> SyncPolicy:
    """Sync-Opt with b backup workers (000_... Alg. 3-4): the first N = n - b gradients of each round are averaged,
    later ones are dropped."""
    return SyncPolicy("backup", backups=backups, deadline=deadline, on_lost=on_lost)


def asynchronous(
    quorum: int = 1,
    timeout: float | None = None,
    c_push: float | None = None,
    c_fetch: float | None = None,
    deadline: float | None = DEADLINE,
    on_lost: str | None = None,
) -> SyncPolicy:
    """ASGD (001_... Alg. 1-2) with quorum 1; with quorum c > 1, updates of c gradients, and with a `timeout`, an
    update of whatever came within `timeout` seconds of its first gradient (for PSP's rounds, see `psp`).

    `c_push` / `c_fetch` make it B-FASGD, as `bfasgd` does (there under its own name).
    """
    return SyncPolicy(
        "async",
        rounds=False,
        quorum=quorum,
        max_lead=None,
        timeout=timeout,
        transmit=transmit(c_push, c_fetch),
        deadline=deadline,
        on_lost=on_lost,
    )


def bfasgd(
    c_push: float | None = 0.1,
    c_fetch: float | None = 0.1,
    quorum: int = 1,
    timeout: float | None = None,
    deadline: float | None = DEADLINE,
    on_lost: str | None = None,
) -> SyncPolicy:
    """B-FASGD (002_... §2.3, eq. 9; with optimizer=fasgd, whose v the server publishes): ASGD whose workers push
    (fetch) at each opportunity iff r < 1 / (1 + c_push / (v + eps)) (c_fetch), r uniform in [0, 1) (`Transmit`);
    a skipped push re-applies the worker's last gradient on the server, a skipped fetch keeps the worker on the
    parameters it has. `quorum`, `timeout` and `deadline` as in `asynchronous`, which it is under its own name.
    """
    return replace(asynchronous(quorum, timeout, c_push, c_fetch, deadline, on_lost), name="bfasgd")


def ssp(
    max_lead: int = 3,
    timeout: float | None = None,
    deadline: float | None = DEADLINE,
    on_lost: str | None = None,
    stream: bool = True,
    patience: float | None = 0.5,
    usual: float | None = 1.5,
) -> SyncPolicy:
    """Stale-synchronous parallel (004_... §II-C): a worker may run at most `max_lead` rounds ahead of the slowest.

    With a `timeout`, a round is applied with the gradients that came within `timeout` seconds of its first one,
    so a frozen worker stops counting as the slowest (its late gradients are dropped).

    `stream` (default): the servers send every version as it is published (`Sent.streams`), so a worker that pushed
    round c need not wait for its own push to land: push and pull cross, a round trip less a round behind a slow
    link. `patience` p: it first holds out for the version its push makes (round c applied) for at most p times the
    seconds its gradient took, then computes round c + 1 on the newest version its bound allows
    (`loops.Worker.holds_out`). On one host the round is mostly complete within that, and the round is fresh.
    `usual` u: it holds out at least u times the median wait that version took over its last `USUAL_OF` pushes (a
    wait it gave up on counts as twice what it held out), so a lag every round has (a host behind a slow link, a
    worker slower every round) is waited for and only an unusual one is skipped. Without it, behind a 5 ms link every
    round of every worker was a round stale (the fresh version came a few ms after p x compute), and the
    Fashion-MNIST CNN at Horovod's lr x n and momentum 0.9 diverged (one seed of two at chance, the other -2.8
    points; delayed heavy ball is stable only to an lr about 12x smaller, `rules.lookahead`); with it every round is
    fresh there (5 repeats: +1.3 points, 1.40x sooner than Horovod, its 3 epochs in 19.8 s against bsp's 21.8 s;
    on the digits MLP 1.13x, where the stale rounds had cost nothing at 1.75x: benchmarks/README.md, "SSP waits for
    the usual").
    Not the worker the rounds wait on (`loops.Worker.closes`: its push completed more than half of the versions it
    read): its wait is its push's way to the server and the version's way back, which every round would take on top
    of its compute; it holds out `patience` alone and computes on the version before (behind a slow link one
    worker's gradient a round stale instead of every round a round trip longer; on one host the version its push
    completes comes within its patience). With the look-ahead's view at the rounds' mean staleness
    (`rules.lookahead`) that gave, with a host behind a 5 ms link, 1.64x sooner than Horovod on the Fashion-MNIST CNN
    (ten repeats, +0.4 points; 1.40x with everyone waiting) and 1.86x on the digits MLP (1.13x):
    benchmarks/README.md, "The worker the rounds wait on".
    Measured before it (benchmarks/README.md, "SSP holds out for the fresh version"): with a host behind a 5 ms link
    (digits MLP, 5 runs) 1.76x sooner than Horovod, against 2.37x with `patience=None` (never wait: every round a
    full `max_lead` stale) and 0.84x with `stream=False`; on the Fashion-MNIST CNN (3 seeds) +1.5 points against
    Horovod without stragglers and -0.8 with heavy-tailed ones, where `patience=None` ended -4.8 (one seed at
    chance) and `stream=False` -1.2 to -1.8. `stream=False`: a worker reads its own writes (the first version its
    bound allows once the server took its push), `patience` unused.
    At `max_lead=0` (BSP) neither applies.
    """
    return SyncPolicy(
        "ssp",
        max_lead=max_lead,
        deadline=deadline,
        timeout=timeout,
        quorum=1 if timeout else None,
        on_lost=on_lost,
        stream=stream and max_lead >= 1,  # bound 0 is BSP: nothing older than the fresh version to compute on
        patience=patience if stream and max_lead >= 1 else None,
        usual=usual if stream and max_lead >= 1 and patience is not None else None,
    )


def psp(
    pushes: int | None = None,
    push_fraction: float | None = 0.875,
    timeout: float | None = None,
    pull_fraction: float = 0.9,
    pull_timeout: float | None = None,
    deadline: float | None = DEADLINE,
    on_lost: str | None = None,
) -> SyncPolicy:
    """PSP-SGD (003_... Alg. 1): partially synchronous rounds.

    Partial push (server lines 5-12): round t is applied once `pushes` (c) gradients of round t came and then either
    every worker responded or `timeout` (tau1) seconds passed; gradients of earlier rounds are dropped. `pushes`
    None takes c = ceil(`push_fraction` x n) instead (`push_quorum`, which says why not floor; None: every
    worker). Partial pull (worker lines 8-15): with
    M >= 2 server shards (`runtime.servers=M`), a worker starts once `pull_fraction` (b) of the shards have the
    round it needs, waiting at most `pull_timeout` (tau2) seconds more for the rest. The paper's learning rate
    scaled by the number d of aggregated gradients is `linear_scaling=true` (eta tuned for c). The defaults are
    the paper's "push:28 of 32, pull:0.9" setting (§5), and like its experiments no timeouts (tau1 = tau2 = 0:
    None here, proceed as soon as the minimum is met).
    """
    return SyncPolicy(
        "psp",
        quorum=pushes,
        push_fraction=None if pushes is not None else push_fraction,
        timeout=timeout,
        pull_fraction=pull_fraction,
        pull_timeout=pull_timeout,
        deadline=deadline,
        on_lost=on_lost,
    )


def specsync(
    base: str = "async",
    max_lead: int | None = None,
    abort_time: float | None = None,
    abort_rate: float | None = None,
    adaptive: bool = True,
    wait: float = 0.0,
    scheduler: str = "server",
    deadline: float | None = DEADLINE,
    on_lost: str | None = None,
) -> SyncPolicy:
    """SpecSync (004_..., Alg. 1-2) over ASP (`base="async"`) or SSP (`base="ssp"`, bound `max_lead`, 3 if null).

    After each push a worker notifies the scheduler (`collsync.specsync.Scheduler`); a worker whose speculation
    period of `abort_time` seconds saw more than m x `abort_rate` pushes of the others is told to re-sync: it aborts
    its gradient, pulls fresh parameters and starts the batch over. `adaptive=true` is SpecSync-Adaptive (both tuned
    each epoch by Alg. 1; leave them null), `adaptive=false` with both set is SpecSync-Cherrypick. `wait` > 0 is
    naive waiting (§III-B: each pull deferred by that many seconds); with `adaptive=false` and no abort_time, it is
    naive waiting alone. `scheduler`: over MPI, "server" runs the scheduler in server rank 0's loop, "rank" on a
    rank of its own (the last one; launch one rank more).
    """
    speculation = Speculation(
        abort_time=abort_time, abort_rate=abort_rate, adaptive=adaptive, wait=wait, scheduler=scheduler
    )
    if base == "async":
        if max_lead is not None:
            raise ValueError(f"specsync: max_lead={max_lead} bounds SSP's lead; it needs base=ssp, not base={base}")
        return SyncPolicy(
            "specsync",
            rounds=False,
            quorum=1,
            max_lead=None,
            deadline=deadline,
            speculation=speculation,
            on_lost=on_lost,
        )
    if base == "ssp":
        lead = 3 if max_lead is None else max_lead
        return SyncPolicy("specsync", max_lead=lead, deadline=deadline, speculation=speculation, on_lost=on_lost)
    raise ValueError(f"specsync: base={base!r} must be 'async' or 'ssp'")
