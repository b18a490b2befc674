"""A link delay made in user space, for kernels without the netem qdisc (scripts/cluster.py starts it).

    ip netns exec collsync-sw python scripts/linkdelay.py node2 dnode2 --delay 5ms [--jitter 1ms]

Forwards every Ethernet frame between two interfaces of one namespace (a host's end of its link, taken off the
bridge, and a second veth whose other end is on the bridge), holding each frame `delay` (+ a uniform draw in
[-jitter, +jitter]) before sending it on, in both directions: the round trip between that host and any other grows
by 2 x delay, as netem on both ends of the link would make it. Frames keep their order in each direction (a frame
never leaves before the one before it, so jitter does not reorder TCP segments).

Raw packet sockets with virtio-net headers (PACKET_VNET_HDR) carry the kernel's segmentation offload through
unchanged, so a 64 KiB TCP segment crosses as one frame. The process adds its own forwarding time (tens of
microseconds, more on a loaded machine): delays much below that are not met, and the measured round trip is what
counts. It runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import heapq
import random
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4  # a frame this host sent (our own writes among them): never forwarded back
FRAME = 65536 + 64


def seconds(text: str) -> float:
    """tc's time words ("5ms", "25us", "0.2s") in seconds."""
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise argparse.ArgumentTypeError(f"{text!r}: give a time in s, ms or us")


def open_raw(dev: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.bind((dev, 0))
    sock.setblocking(False)
    return sock


def forward(a: str, b: str, delay: float, jitter: float, seed: int) -> None:
    """Hold each frame from `a` for `delay` (+- `jitter`) and send it out of `b`, and the other way round."""
    socks = {a: open_raw(a), b: open_raw(b)}
    other = {socks[a].fileno(): socks[b], socks[b].fileno(): socks[a]}
    last = {a: 0.0, b: 0.0}  # each direction's last departure: frames keep their order
    draw = random.Random(seed)
    queue: list[tuple[float, int, socket.socket, bytes]] = []
    count = 0
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, frame = heapq.heappop(queue)
            try:
                out.send(frame)
            except OSError:
                pass  # the link went down (a cut): the frame is lost, as on a wire
        wait = max(queue[0][0] - now, 0.0) if queue else 1.0
        ready, _, _ = select.select(list(socks.values()), [], [], wait)
        for sock in ready:
            while True:
                try:
                    frame, address = sock.recvfrom(FRAME)
                except (BlockingIOError, OSError):
                    break
                if address[2] == PACKET_OUTGOING:
                    continue
                out = other[sock.fileno()]
                due = time.monotonic() + delay + (draw.uniform(-jitter, jitter) if jitter else 0.0)
                direction = address[0]
                due = max(due, last[direction])
                last[direction] = due
                count += 1
                heapq.heappush(queue, (due, count, out, frame))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="one interface (a host's end of its link, off the bridge)")
    parser.add_argument("b", help="the other (a veth whose peer is on the bridge)")
    parser.add_argument("--delay", type=seconds, required=True)
    parser.add_argument("--jitter", type=seconds, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    forward(args.a, args.b, args.delay, args.jitter, args.seed)


if __name__ == "__main__":
    main()
