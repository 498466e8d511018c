#!/usr/bin/env python3
"""The gateway's CPU time per connection, for builds side by side.

    cargo build --release   # at each commit; copy target/release/snowgate aside
    bench/connection_cost.py SNOWGATE_A SNOWGATE_B [ROUNDS]

For each binary in turns, ROUNDS times (3), starts `snowgate serve` with its
built-in echo upstream and one worker, sends N (env N, 5000) requests of
bench/load.py's 1 KiB context-only chat body, each on a connection of its own
(`Connection: close`), one at a time, and prints the gateway's CPU time
(user + system, from /proc/PID/stat) per request, and the median of each
binary's rounds. What a connection costs the gateway beyond its request:
accepting it, serving it, closing it. Needs python3 and Linux.
"""

import os
import socket
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load import make_bodies, wait_ready  # noqa: E402

N = int(os.environ.get("N", "5000"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15; after the name, 12 and 13.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def exchange(port, request):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(request)
        reply = b""
        while True:
            got = s.recv(65536)
            if not got:
                break
            reply += got
    if not reply.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"unexpected reply: {reply[:200]!r}")


def round_of(binary):
    port, admin = free_port(), free_port()
    # Kept where the gateway does not start, for the message that names it.
    log = tempfile.NamedTemporaryFile(prefix="snowgate-connection-cost-", suffix=".log",
                                      delete=False)
    gateway = subprocess.Popen(
        [binary, "serve", "--listen", f"127.0.0.1:{port}",
         "--admin-listen", f"127.0.0.1:{admin}", "--machine-id", "1",
         "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        # Ready, not merely listening: the admin listener opens before the
        # plugin has compiled and the request listener has.
        wait_ready(f"http://127.0.0.1:{admin}/readyz", gateway, log.name, timeout=120)
        os.unlink(log.name)
        body = make_bodies()["1KiB"]
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body
        for _ in range(200):  # warm up
            exchange(port, request)
        before = cpu_seconds(gateway.pid)
        for _ in range(N):
            exchange(port, request)
        return (cpu_seconds(gateway.pid) - before) / N
    finally:
        gateway.terminate()
        gateway.wait()
        log.close()


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    binaries = sys.argv[1:3]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    seen = {b: [] for b in binaries}
    for r in range(rounds):
        for b in binaries:
            seen[b].append(round_of(b))
            print(f"round {r + 1} {b}: {seen[b][-1] * 1e6:.1f} us of CPU a request",
                  flush=True)
    medians = {b: statistics.median(v) for b, v in seen.items()}
    for b in binaries:
        print(f"median {b}: {medians[b] * 1e6:.1f} us")
    a, b = binaries
    print(f"ratio {b} / {a}: {medians[b] / medians[a]:.3f}")


if __name__ == "__main__":
    main()
