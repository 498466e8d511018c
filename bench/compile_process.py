#!/usr/bin/env python3
"""What compiling each plugin build in a child process costs and saves, binaries side by side.

    cargo build --release        # each build copied aside, e.g. /tmp/snowgate-before
    python3 bench/compile_process.py /tmp/snowgate-before /tmp/snowgate-after [--rounds 10] [--reloads 50]

For each binary in turn, --rounds times:
  - starts `snowgate serve` with the bundled plugin and times it to its ready line; reads the
    gateway's peak resident memory (VmHWM) then;
  - in --reload-rounds gateways serving a plugin file (the bundled plugin with a custom section
    appended, the watcher off), writes --reloads new builds one after another, each renamed over
    the file and swapped in by `POST /reload`, timing each POST; reads the gateway's peak and
    current resident memory after the last.
Prints medians. Needs a release build (target/wasm32-wasip2/release/snowgate_plugin.wasm is the
plugin). Python standard library only.
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.path.join(ROOT, "target", "wasm32-wasip2", "release", "snowgate_plugin.wasm")


def variant(plugin, n):
    """The plugin with a custom section holding N: a new SHA-256, the same behaviour."""
    name = b"snowgate-variant"
    payload = n.to_bytes(4, "little")
    return plugin + bytes([0, 1 + len(name) + len(payload), len(name)]) + name + payload


def memory_kib(pid):
    """(VmHWM, VmRSS) of PID, in KiB."""
    fields = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmHWM"].split()[0]), int(fields["VmRSS"].split()[0])


def serve(binary, extra):
    """Starts `snowgate serve` on free ports; (process, seconds to its ready line, admin URL)."""
    began = time.monotonic()
    process = subprocess.Popen(
        [binary, "serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
         "--machine-id", "1"] + extra,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = process.stdout.readline().decode()
    seconds = time.monotonic() - began
    found = re.search(r"\(admin (\S+)\)", line)
    if not found:
        process.kill()
        raise RuntimeError("%s printed no ready line: %r" % (binary, line))
    return process, seconds, found.group(1)


def stop(process):
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def start_once(binary):
    """Seconds to the ready line with the bundled plugin, and the peak RSS then (KiB)."""
    process, seconds, _ = serve(binary, [])
    peak, _ = memory_kib(process.pid)
    stop(process)
    return seconds, peak


def reloads(binary, plugin, count, base):
    """POST /reload times (ms) for COUNT new builds, and (peak, current) RSS after them."""
    # Removed with what it holds once the round is done.
    with tempfile.TemporaryDirectory(prefix="snowgate-compile-process-") as workdir:
        path = os.path.join(workdir, "plugin.wasm")
        with open(path, "wb") as f:
            f.write(variant(plugin, base))
        process, _, admin = serve(binary, ["--plugin", path, "--reload-debounce-ms", "600000"])
        try:
            times = []
            for n in range(base + 1, base + 1 + count):
                with open(path + ".tmp", "wb") as f:
                    f.write(variant(plugin, n))
                os.rename(path + ".tmp", path)
                began = time.monotonic()
                request = urllib.request.Request(admin + "/reload", data=b"", method="POST")
                with urllib.request.urlopen(request, timeout=60) as reply:
                    answer = reply.read()
                times.append((time.monotonic() - began) * 1000)
                assert b"swapped" in answer, answer
            memory = memory_kib(process.pid)
        finally:
            # A round that failed leaves no gateway behind either.
            stop(process)
    return times, memory


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binaries", nargs="+")
    parser.add_argument("--rounds", type=int, default=10, help="starts per binary (default 10)")
    parser.add_argument("--reload-rounds", type=int, default=3,
                        help="gateways reloaded per binary (default 3)")
    parser.add_argument("--reloads", type=int, default=50, help="reloads per gateway (default 50)")
    args = parser.parse_args()
    with open(PLUGIN, "rb") as f:
        plugin = f.read()
    starts = {b: [] for b in args.binaries}
    reloaded = {b: [] for b in args.binaries}
    # In turns, so that what else the machine does falls on every binary alike.
    for _ in range(args.rounds):
        for binary in args.binaries:
            starts[binary].append(start_once(binary))
    for r in range(args.reload_rounds):
        for binary in args.binaries:
            reloaded[binary].append(reloads(binary, plugin, args.reloads, r * 10_000))
    print("| binary | start to ready, median | peak RSS at start | POST /reload, median (p90) "
          "| peak RSS after %d reloads | RSS after them |" % args.reloads)
    print("|---|---:|---:|---:|---:|---:|")
    for binary in args.binaries:
        seconds = [s * 1000 for s, _ in starts[binary]]
        peaks = [p / 1024 for _, p in starts[binary]]
        times = sorted(t for run, _ in reloaded[binary] for t in run)
        after = reloaded[binary]
        print("| %s | %.1f ms | %.1f MiB | %.1f ms (%.1f) | %s MiB | %s MiB |" % (
            binary, statistics.median(seconds), statistics.median(peaks),
            statistics.median(times), times[int(len(times) * 0.9)],
            ", ".join("%d" % (m[0] // 1024) for _, m in after),
            ", ".join("%d" % (m[1] // 1024) for _, m in after)))


if __name__ == "__main__":
    main()
