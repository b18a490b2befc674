"""A cluster in one box: hosts as Linux network namespaces on one bridge, for running collsync across hosts over TCP.

    python scripts/cluster.py up [--hosts 3] [--link 10gbe]   # or: bash scripts/cluster_up.sh
    DIR/bin/mpiexec -hosts node0:2,node1:2,node2:1 -n 5 .venv/bin/python -m mpi4py -m collsync.cli ...
    DIR/bin/mpirun-openmpi --host node0:2,node1:2,node2:1 -n 5 .venv-openmpi/bin/python -m mpi4py -m collsync.cli ...
    python scripts/cluster.py link node2 slow-host            # a link model on one host's link (or `none`)
    python scripts/cluster.py cut node2 / mend node2          # take its link down / up again (a partition)
    python scripts/cluster.py kill node2                      # end every process on that host (a lost host)
    python scripts/cluster.py cpu node2 0.25                  # its processes held to a quarter of one core (or none)
    python scripts/cluster.py down                            # or: bash scripts/cluster_down.sh

DIR is $COLLSYNC_CLUSTER_DIR or /tmp/collsync-cluster. Each host `nodeI` is a network namespace of that name with
one veth link `eth0` (10.77.0.(10+I)/24) to a bridge that lives in a namespace of its own (`collsync-sw`), so no
address or link is made outside the namespaces this script creates. Names resolve through /etc/netns/<host>/hosts
(`ip netns exec` mounts it over /etc/hosts). A process started through DIR/bin/launch (MPICH's `-launcher-exec`,
Open MPI's `plm_ssh_agent`) runs in the host's namespace with the host's name (`unshare -u`), so ranks on different
hosts share no memory and talk over TCP through the bridge.

Link models sit on both ends of a host's link (the host's egress and the bridge port's egress towards it): a message
between two hosts crosses both hosts' links, so its one-way delay is the sum of their delays (a model on one host
only: that host's delay and loss). Presets: 10gbe (10 Gbit/s, 25 us), 1gbe (1 Gbit/s, 50 us), slow-host (5 ms),
slow-link (20 Mbit/s), lossy (1% loss), none; or a spec such as `rate=1gbit,delay=50us,jitter=10us,loss=0.5%`. They
are `tc netem` where the kernel has it. A kernel built without netem (some VMs' are) gets the rate from `tbf`, the
loss from a BPF filter that drops packets at random (built with LLVM's llc), and a delay of 1 ms or more from
scripts/linkdelay.py: the host's bridge port is taken off the bridge and a process in the bridge's namespace holds
each frame between it and a second port for the delay, both ways (round trip + 2 x delay, as netem on both ends).
That process adds its own forwarding time and caps the link at a few hundred Mbit/s, so delays under 1 ms (the 10gbe
and 1gbe presets') are left out there, saying so: those presets are then their rate alone.

A host's CPU can be slowed too (`cpu HOST SHARE`): every process started on it from then on (DIR/bin/launch puts it
there) runs in a cgroup of its own whose CPU quota is SHARE of one core, as a host whose cores a CPU-bound neighbour
shares.

Needs root (namespaces, veth, tc). Where it cannot make them, `up` writes one line to DIR/unavailable (tests/cluster
skip with it), prints it and exits 1. `up` is idempotent (a complete cluster is kept, a partial one remade); `down`
ends the processes in the cluster's namespaces (only those: it started them), removes every namespace, link and
file it made, and is safe to run when nothing is up. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

DIR = Path(os.environ.get("COLLSYNC_CLUSTER_DIR", "/tmp/collsync-cluster"))
SWITCH = "collsync-sw"
SUBNET = "10.77.0"
PRESETS = {
    "10gbe": {"rate": "10gbit", "delay": "25us"},
    "1gbe": {"rate": "1gbit", "delay": "50us"},
    "slow-host": {"delay": "5ms"},
    "slow-link": {"rate": "20mbit"},
    "lossy": {"loss": "1%"},
    "none": {},
}
ROOT = Path(__file__).resolve().parents[1]

# Drops a packet when a random u32 is below THRESHOLD (TC_ACT_SHOT = 2, else TC_ACT_OK = 0); helper 7 is
# bpf_get_prandom_u32. The license section lets the kernel load it.
LOSS_IR = """target datalayout = "e-m:e-p:64:64-i64:64-i128:128-n32:64-S128"
target triple = "bpf"
@_license = global [4 x i8] c"GPL\\00", section "license", align 1
@llvm.used = appending global [2 x i8*] [i8* getelementptr inbounds ([4 x i8], [4 x i8]* @_license, i32 0, i32 0),
  i8* bitcast (i32 (i8*)* @drop to i8*)], section "llvm.metadata"
define i32 @drop(i8* %skb) section "classifier" {
  %r = call i64 inttoptr (i64 7 to i64 ()*)()
  %u = and i64 %r, 4294967295
  %lost = icmp ult i64 %u, THRESHOLD
  %act = select i1 %lost, i32 2, i32 0
  ret i32 %act
}
"""

# MPICH's hydra and Open MPI's prte call the launcher as `launch HOST COMMAND...`; prte passes the command as one
# shell string, hydra as words, so both are run by a shell inside the host's namespace with the host's name.
LAUNCH = """#!/bin/sh
# Written by scripts/cluster.py: run a command on one host of the cluster in one box (its namespace, its name).
# Options before the host (ssh-style flags some launchers add) are skipped.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
# A host whose CPU is held (`cluster.py cpu`): the command joins its cgroup first. Called by a launcher inside the
# first host's namespace, where `ip netns exec` hid /sys/fs/cgroup, it writes from the mount namespace of the process
# that called the box's mpiexec (COLLSYNC_CLUSTER_CALLER, set there).
cpu="$(dirname "$0")/../cpu/$host"
if [ -f "$cpu" ]; then
    procs=$(cat "$cpu")
    if [ -w "$procs" ]; then
        echo $$ > "$procs"
    else
        nsenter -t "${COLLSYNC_CLUSTER_CALLER:-1}" -m sh -c "echo $$ > '$procs'" ||
            echo "launch: $host's processes not held to its CPU share" >&2
    fi
fi
exec ip netns exec "$host" unshare -u sh -c 'hostname "$0"; exec sh -c "$*"' "$host" "$@"
"""
MPICH = """#!/bin/sh
# Written by scripts/cluster.py: MPICH's mpiexec run on the first host, starting ranks on hosts through DIR/bin/launch.
# UCX (the wheel's netmod) would carry every message between the hosts through shared memory (/dev/shm and the
# kernel are the same for every namespace, and UCX's shm transports see one machine): tcp and self only, so that
# ranks on different hosts talk over the hosts' links (which link models, cut and mend then act on).
export UCX_TLS="${{UCX_TLS:-tcp,self}}"
export COLLSYNC_CLUSTER_CALLER="${{COLLSYNC_CLUSTER_CALLER:-$PPID}}"  # outside the hosts' namespaces: see launch
exec ip netns exec {head} unshare -u sh -c 'hostname {head}; exec "$@"' sh {mpiexec} -launcher rsh \\
    -launcher-exec {launch} "$@"
"""
OPENMPI = """#!/bin/sh
# Written by scripts/cluster.py: Open MPI's mpirun run on the first host, its daemons started through DIR/bin/launch.
# Open MPI refuses root without the two ALLOW variables and prints a warning per window from its UCX component.
# --map-by slot: places ranks as --host's slot counts say (its default mapping, by package, put all on the first).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc=^ucx
export COLLSYNC_CLUSTER_CALLER="${{COLLSYNC_CLUSTER_CALLER:-$PPID}}"  # outside the hosts' namespaces: see launch
exec ip netns exec {head} unshare -u sh -c 'hostname {head}; exec "$@"' sh {mpirun} --prtemca plm_ssh_agent {launch} \\
    --oversubscribe --map-by slot "$@"
"""


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command quietly; on failure exit with one line naming it."""
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        sys.exit(f"cluster: `{' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def namespaces() -> set[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def state() -> dict | None:
    """What `up` made (hosts, addresses), or None when no cluster was made in DIR."""
    path = DIR / "cluster.json"
    return json.loads(path.read_text()) if path.exists() else None


def parse_model(model: str) -> dict[str, str]:
    """A preset or a `key=value,...` spec as {rate, delay, jitter, loss}; {} for no model."""
    if model in PRESETS:
        return dict(PRESETS[model])
    try:
        spec = dict(part.split("=", 1) for part in model.split(",") if part)
    except ValueError:
        sys.exit(f"cluster: link model {model!r} is neither a preset ({', '.join(PRESETS)}) nor key=value,...")
    unknown = set(spec) - {"rate", "delay", "jitter", "loss"}
    if unknown:
        sys.exit(f"cluster: link model {model!r}: unknown keys {sorted(unknown)} (rate, delay, jitter, loss)")
    return spec


def netem_args(spec: dict[str, str]) -> list[str]:
    args: list[str] = []
    if "delay" in spec or "jitter" in spec:
        args += ["delay", spec.get("delay", "0us")] + ([spec["jitter"]] if "jitter" in spec else [])
    for key in ("rate", "loss"):
        args += [key, spec[key]] if key in spec else []
    return args


def loss_filter(loss: str) -> Path:
    """A tc BPF program (direct action) that drops each packet with probability `loss` ("1%"): for kernels without
    netem (nor the gact action), built from LLVM IR with llc, since no C compiler for BPF may be installed."""
    threshold = round(float(loss.rstrip("%")) / 100 * 2**32)
    obj = DIR / f"loss-{threshold}.o"
    if obj.exists():
        return obj
    llc = shutil.which("llc") or next((str(p) for p in sorted(Path("/usr/lib").glob("llvm-*/bin/llc"))), None)
    if llc is None:
        sys.exit("cluster: packet loss needs netem (CONFIG_NET_SCH_NETEM) or llc (LLVM) to build a BPF filter")
    source = DIR / f"loss-{threshold}.ll"
    source.write_text(LOSS_IR.replace("THRESHOLD", str(threshold)))
    sh(llc, "-march=bpf", "-filetype=obj", "-o", str(obj), str(source))
    return obj


USER_DELAY_MIN_S = 1e-3  # below this the user-space forwarder's own time (0.1-1 ms here) would be most of it


def start_delay(host: str, spec: dict[str, str]) -> None:
    """A delay without netem: `host`'s bridge port off the bridge, scripts/linkdelay.py forwarding between it and a
    new port `d<host>` (on the bridge) with the delay. Runs in the bridge's namespace, so `down` ends it too."""
    delay = seconds(spec["delay"])
    if delay < USER_DELAY_MIN_S:
        print(f"cluster: {host}'s link: delay {spec['delay']} left out (no netem here, and under 1 ms)")
        return
    relay = f"d{host}"
    sh("ip", "-n", SWITCH, "link", "add", relay, "type", "veth", "peer", "name", f"{relay}b")
    sh("ip", "-n", SWITCH, "link", "set", f"{relay}b", "master", "br0", "up")
    sh("ip", "-n", SWITCH, "link", "set", relay, "up")
    sh("ip", "-n", SWITCH, "link", "set", host, "nomaster")
    jitter = ["--jitter", spec["jitter"]] if "jitter" in spec else []
    forwarder = [sys.executable, str(ROOT / "scripts" / "linkdelay.py"), host, relay, "--delay", spec["delay"]]
    with (DIR / f"delay-{host}.log").open("w") as log:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", SWITCH, *forwarder, *jitter], stdout=log, stderr=log, start_new_session=True
        )
    (DIR / f"delay-{host}.pid").write_text(str(proc.pid))


def stop_delay(host: str) -> None:
    """Undo `start_delay` (nothing when `host` has no such delay)."""
    pidfile = DIR / f"delay-{host}.pid"
    if pidfile.is_file():
        try:
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
        except ProcessLookupError:
            pass
        pidfile.unlink()
    if sh("ip", "-n", SWITCH, "link", "del", f"d{host}", check=False).returncode == 0:
        sh("ip", "-n", SWITCH, "link", "set", host, "master", "br0", "up")


def seconds(text: str) -> float:
    """tc's time words ("5ms", "25us", "1s") in seconds."""
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    sys.exit(f"cluster: time {text!r}: give it in s, ms or us")


def without_netem(ns: str, dev: str, spec: dict[str, str]) -> None:
    """Rate by tbf, loss by a BPF filter and (once per link, from the bridge's side) a delay by
    scripts/linkdelay.py, on a kernel that has no netem."""
    if "delay" in spec and ns == SWITCH:
        start_delay(dev, spec)
    if "rate" in spec:
        burst = max(int(rate_bits(spec["rate"]) / 8 / 1000), 16384)  # a millisecond of traffic, at least a few packets
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            spec["rate"],
            "burst",
            str(burst),
            "latency",
            "20ms",
        )
    if "loss" in spec:
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "clsact")
        obj = loss_filter(spec["loss"])
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "filter",
            "add",
            "dev",
            dev,
            "egress",
            "bpf",
            "da",
            "obj",
            str(obj),
            "sec",
            "classifier",
        )


def rate_bits(rate: str) -> float:
    """tc's rate words ("10gbit", "20mbit", "500kbit") in bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    sys.exit(f"cluster: rate {rate!r}: give it in gbit, mbit or kbit")


def set_link(host: str, model: str) -> None:
    """Put `model` on both ends of `host`'s link (or take every model off for `none`)."""
    spec = parse_model(model)
    stop_delay(host)
    for ns, dev in ((host, "eth0"), (SWITCH, host)):
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "clsact", check=False)
        if not spec:
            continue
        proc = sh(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "netem",
            *netem_args(spec),
            check=False,
        )
        if proc.returncode != 0:
            if "unknown" not in proc.stderr:
                sys.exit(f"cluster: tc netem on {host}'s link: {proc.stderr.strip()}")
            without_netem(ns, dev, spec)
    print(f"cluster: {host}'s link: {model} ({', '.join(f'{k} {v}' for k, v in spec.items()) or 'no model'})")


def cpu_controller() -> tuple[Path, str]:
    """The cpu controller's folder and its quota file: cgroup v1's `cpu` hierarchy, or v2's unified one."""
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    if (v1 / "cpu.cfs_quota_us").is_file():
        return v1, "cpu.cfs_quota_us"
    controllers = v2 / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        return v2, "cpu.max"
    sys.exit("cluster: cpu needs a cpu cgroup controller (/sys/fs/cgroup/cpu, or cgroup v2 with cpu enabled)")


def hold(name: str, share: float | None) -> Path:
    """The cgroup `name` under the cpu controller, its processes held to `share` of one core (made if need be), or
    (None) removed once its processes ended; its folder. Also benchmarks/horovod_stragglers.py's shared-core."""
    root, quota = cpu_controller()
    group = root / name
    if share is None:
        try:
            group.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            print(f"cluster: {group} kept ({exc}: processes still in it)")
        return group
    if not 0 < share <= 1:
        sys.exit(f"cluster: cpu {name} {share}: the share of one core must be in (0, 1]")
    period = 100_000
    try:
        group.mkdir(exist_ok=True)
        (group / quota).write_text(
            str(int(share * period)) if quota == "cpu.cfs_quota_us" else f"{int(share * period)} {period}"
        )
    except OSError as exc:
        sys.exit(f"cluster: cannot set a CPU quota in {group} ({exc}): root only")
    return group


def cpu_group(host: str) -> str:
    """The name of the cgroup `set_cpu` holds `host`'s processes in."""
    return f"collsync-cluster-{host}"


def set_cpu(host: str, share: float | None) -> None:
    """Hold every process started on `host` from now on to `share` of one core (a cgroup CPU quota; DIR/bin/launch
    moves each into it), or (None) start them unheld again and remove the cgroup once its processes ended."""
    marker = DIR / "cpu" / host
    if share is None:
        marker.unlink(missing_ok=True)
        hold(cpu_group(host), None)
        print(f"cluster: {host}'s CPU: unheld")
        return
    group = hold(cpu_group(host), share)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(group / "cgroup.procs"))
    print(f"cluster: {host}'s CPU: {share:g} of one core for every process started there ({group})")


def unavailable(why: str) -> None:
    DIR.mkdir(parents=True, exist_ok=True)
    (DIR / "unavailable").write_text(why + "\n")
    sys.exit(f"cluster: {why}")


def write_scripts(hosts: list[str]) -> None:
    """DIR/bin/launch (the launcher both MPIs call), DIR/bin/mpiexec (MPICH) and DIR/bin/mpirun-openmpi."""
    bin_dir = DIR / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    launch = bin_dir / "launch"
    venv_mpich = ROOT / ".venv" / "bin" / "mpiexec"
    venv_ompi = ROOT / ".venv-openmpi" / "bin" / "mpirun"
    files = {
        launch: LAUNCH,
        bin_dir / "mpiexec": MPICH.format(head=hosts[0], mpiexec=venv_mpich, launch=launch),
        bin_dir / "mpirun-openmpi": OPENMPI.format(head=hosts[0], mpirun=venv_ompi, launch=launch),
    }
    for path, text in files.items():
        path.write_text(text)
        path.chmod(0o755)


def up(count: int, model: str) -> None:
    """Make `count` hosts on one bridge (or keep a complete cluster of that size), with `model` on every link."""
    if os.geteuid() != 0:
        unavailable(f"needs root to make network namespaces, veth links and tc qdiscs (uid is {os.geteuid()})")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            unavailable(f"`{tool}` is not installed (iproute2 and util-linux make the cluster)")
    hosts = [f"node{i}" for i in range(count)]
    made = state()
    if made is not None and made["hosts"] == hosts and set(hosts) | {SWITCH} <= namespaces():
        print(f"cluster: already up ({', '.join(hosts)}; {DIR})")
    else:
        down(quiet=True)
        make(hosts)
    write_scripts(hosts)  # also where the cluster was kept: a test may have changed them
    for host in hosts:
        set_link(host, model)


def make(hosts: list[str]) -> None:
    (DIR / "unavailable").unlink(missing_ok=True)
    DIR.mkdir(parents=True, exist_ok=True)
    # Recorded first, so that `down` finds whatever part of the cluster a failure below leaves behind.
    (DIR / "cluster.json").write_text(json.dumps({"hosts": hosts, "switch": SWITCH, "subnet": SUBNET}))
    try:
        sh("ip", "netns", "add", SWITCH)
    except SystemExit as error:
        unavailable(f"cannot make network namespaces here ({error})")
    sh("ip", "-n", SWITCH, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", SWITCH, "link", "set", "br0", "up")
    names = "127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{10 + i} {h}\n" for i, h in enumerate(hosts))
    for i, host in enumerate(hosts):
        sh("ip", "netns", "add", host)
        sh("ip", "link", "add", "eth0", "netns", host, "type", "veth", "peer", "name", host, "netns", SWITCH)
        sh("ip", "-n", SWITCH, "link", "set", host, "master", "br0", "up")
        sh("ip", "-n", host, "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", "eth0")
        sh("ip", "-n", host, "link", "set", "eth0", "up")
        sh("ip", "-n", host, "link", "set", "lo", "up")
        etc = Path("/etc/netns") / host
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(names)
    print(f"cluster: up with {', '.join(hosts)} on {SUBNET}.0/24 ({DIR}); MPICH: {DIR}/bin/mpiexec")


def pids_in(ns: str) -> list[int]:
    return [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]


def kill_host(host: str, wait_s: float = 5.0) -> int:
    """End every process in `host`'s namespace (SIGKILL: a host that is lost says nothing); the count ended."""
    pids = pids_in(host)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while pids_in(host) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(pids)


def down(quiet: bool = False) -> None:
    """End the processes in the cluster's namespaces, remove the namespaces (their links go with them) and files."""
    made = state()
    hosts = made["hosts"] if made else []
    present = namespaces()
    for ns in [*hosts, SWITCH]:
        if ns in present:
            ended = kill_host(ns)
            sh("ip", "netns", "del", ns, check=False)
            if not quiet:
                print(f"cluster: removed {ns}" + (f" (ended {ended} processes)" if ended else ""))
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
    try:
        Path("/etc/netns").rmdir()  # only when empty: other namespaces' files stay
    except OSError:
        pass
    for host in [p.name for p in (DIR / "cpu").glob("*")]:
        set_cpu(host, None)
    for path in [DIR / "cluster.json", DIR / "unavailable", *DIR.glob("loss-*.*"), *DIR.glob("delay-*.*")]:
        path.unlink(missing_ok=True)
    shutil.rmtree(DIR / "cpu", ignore_errors=True)
    shutil.rmtree(DIR / "bin", ignore_errors=True)
    try:
        DIR.rmdir()
    except OSError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="make the hosts (idempotent)")
    p_up.add_argument("--hosts", type=int, default=int(os.environ.get("COLLSYNC_CLUSTER_HOSTS", 3)))
    p_up.add_argument("--link", default=os.environ.get("COLLSYNC_CLUSTER_LINK", "none"), help="preset or spec")
    sub.add_parser("down", help="remove everything `up` made")
    sub.add_parser("status", help="print the hosts and their link models")
    p_link = sub.add_parser("link", help="a link model on one host's link")
    p_link.add_argument("host")
    p_link.add_argument("model")
    p_cpu = sub.add_parser("cpu", help="hold the processes started on a host to a share of one core")
    p_cpu.add_argument("host")
    p_cpu.add_argument("share", help="a share of one core in (0, 1], or none")
    for name, what in (("cut", "take a host's link down"), ("mend", "bring it up"), ("kill", "end its processes")):
        sub.add_parser(name, help=what).add_argument("host")
    args = parser.parse_args()
    if args.command == "up":
        up(args.hosts, args.link)
        return
    if args.command == "down":
        down()
        return
    made = state()
    if made is None:
        sys.exit(f"cluster: none is up in {DIR} (python scripts/cluster.py up)")
    if args.command == "status":
        for host in made["hosts"]:
            qdisc = sh("ip", "netns", "exec", host, "tc", "qdisc", "show", "dev", "eth0", check=False).stdout
            print(f"{host}: pids {pids_in(host)}; {qdisc.strip()}")
        return
    if args.host not in made["hosts"]:
        sys.exit(f"cluster: no host {args.host!r} (hosts: {', '.join(made['hosts'])})")
    if args.command == "link":
        set_link(args.host, args.model)
    elif args.command == "cpu":
        set_cpu(args.host, None if args.share == "none" else float(args.share))
    elif args.command in ("cut", "mend"):
        sh("ip", "-n", args.host, "link", "set", "eth0", "down" if args.command == "cut" else "up")
    else:
        print(f"cluster: ended {kill_host(args.host)} processes on {args.host}")


if __name__ == "__main__":
    main()
