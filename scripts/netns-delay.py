#!/usr/bin/env python3
"""A delayed link between two network namespaces, in user space, for kernels
without tc netem (scripts/netns-lab.sh starts it; root only).

    netns-delay.py DELAY_MS NS_A TAP_A NS_B TAP_B [NS_A TAP_A NS_B TAP_B ...]

Each group of four names two persistent TAP devices (`ip tuntap add mode
tap`), one in each namespace. Every Ethernet frame read from one is written
to the other DELAY_MS / 2 later, in order: a cable whose round trip is
DELAY_MS. Prints `ready` once every device is attached; runs until killed.
"""

import collections
import ctypes
import fcntl
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
MAX_FRAME = 65536
# Frames held per direction; past it the cable drops, as a full queue does.
MAX_HELD = 4096

libc = ctypes.CDLL(None, use_errno=True)


def enter(namespace):
    """Make this process's network namespace `namespace` (an `ip netns` name)."""
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns {namespace}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def attach(namespace, device):
    """An open file on the TAP `device` of `namespace` (the device is looked
    up in the namespace the file was opened in)."""
    enter(namespace)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main(argv):
    if len(argv) < 6 or (len(argv) - 2) % 4 != 0:
        sys.exit(__doc__)
    one_way = float(argv[1]) / 2000.0
    peer = {}
    for i in range(2, len(argv), 4):
        a = attach(argv[i], argv[i + 1])
        b = attach(argv[i + 2], argv[i + 3])
        peer[a], peer[b] = b, a
    # Frames on their way to each file: (due, frame), due times ascending.
    held = {fd: collections.deque() for fd in peer}
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        for out, queue in held.items():
            while queue and queue[0][0] <= now:
                _, frame = queue.popleft()
                try:
                    os.write(out, frame)
                except OSError:
                    pass  # a device down or full drops the frame, as a cable would
        due = [queue[0][0] for queue in held.values() if queue]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        # select sleeps on a high-resolution timer (poll and epoll round
        # their timeouts up to whole milliseconds).
        readable, _, _ = select.select(list(peer), [], [], timeout)
        arrived = time.monotonic()
        for fd in readable:
            while True:
                try:
                    frame = os.read(fd, MAX_FRAME)
                except BlockingIOError:
                    break
                queue = held[peer[fd]]
                if len(queue) < MAX_HELD:
                    queue.append((arrived + one_way, frame))


if __name__ == "__main__":
    main(sys.argv)
