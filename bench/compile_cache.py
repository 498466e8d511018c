#!/usr/bin/env python3
"""What `--plugin-cache-dir` saves for a plugin that is slow to compile.

Builds bench/python-plugin/app.py twice with componentize-py (builds A and B,
differing in one constant), then, with `target/release/snowgate`:
- starts `snowgate serve` on build A, alternately without and with a warm
  compile cache, and times each start to its ready line (and its peak RSS);
- in one gateway without and one with the cache, swaps the plugin file to B
  and back to A by rename, and times each swap back to A until `/status`
  shows A serving (the reload's 200 ms quiet time included).
Every start and reload must serve A and stamp a context-only request.

    cargo build --release
    python3 bench/compile_cache.py [--rounds 3]

componentize-py is installed in a virtual environment under
target/compile-cache-bench/ (from PyPI), which also holds the builds.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNOWGATE = os.path.join(ROOT, "target", "release", "snowgate")
# The binary measured: --snowgate, SNOWGATE by default.
SNOWGATE_BINARY = SNOWGATE
WORK = os.path.join(ROOT, "target", "compile-cache-bench")
COMPONENTIZE_PY = "componentize-py==0.25.1"
CONTEXT_ONLY = b'{"prompt":"x","disaggregated_params":{"request_type":"context_only"}}'


def build_plugins():
    """Builds A and B; returns {name: (path, sha256 hex)}."""
    venv = os.path.join(WORK, "venv")
    tool = os.path.join(venv, "bin", "componentize-py")
    if not os.path.exists(tool):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--quiet", COMPONENTIZE_PY], check=True)
    source = open(os.path.join(ROOT, "bench", "python-plugin", "app.py")).read()
    builds = {}
    for name in ("A", "B"):
        src = os.path.join(WORK, "src-" + name)
        os.makedirs(src, exist_ok=True)
        with open(os.path.join(src, "app.py"), "w") as f:
            f.write(source.replace('BUILD_MARK = "A"', 'BUILD_MARK = "%s"' % name))
        out = os.path.join(WORK, "plugin-%s.wasm" % name)
        if not os.path.exists(out):
            subprocess.run([tool, "-d", os.path.join(ROOT, "wit"), "-w", "middleware", "componentize",
                            "-p", src, "-o", out, "app"], check=True)
        sha = subprocess.run(["sha256sum", out], check=True, capture_output=True, text=True).stdout.split()[0]
        builds[name] = (out, sha)
        print("build %s: %s, %.1f MB, sha256 %s" % (name, out, os.path.getsize(out) / 1e6, sha), flush=True)
    return builds


class Gateway:
    """`snowgate serve` on free ports, on `plugin.wasm` in `workdir`."""

    def __init__(self, workdir, cache):
        cmd = [SNOWGATE_BINARY, "serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
               "--machine-id", "1", "--plugin", "plugin.wasm"]
        if cache:
            cmd += ["--plugin-cache-dir", cache]
        self.stderr = open(os.path.join(workdir, "stderr.log"), "ab")
        began = time.monotonic()
        self.process = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=self.stderr)
        line = self.process.stdout.readline().decode()
        self.start_seconds = time.monotonic() - began
        found = re.search(r"listening on (\S+) \(admin (\S+)\)", line)
        if not found:
            self.process.kill()
            raise RuntimeError("no ready line: %r; see %s/stderr.log" % (line, workdir))
        self.listen, self.admin = found.group(1), found.group(2)

    def status(self):
        with urllib.request.urlopen(self.admin + "/status", timeout=5) as reply:
            return json.load(reply)

    def assert_stamps(self):
        request = urllib.request.Request(self.listen + "/v1/completions", data=CONTEXT_ONLY,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            echoed = json.load(reply)
        assert isinstance(echoed["body"]["disaggregated_params"]["disagg_request_id"], int), echoed

    def peak_rss_mib(self):
        with open("/proc/%d/status" % self.process.pid) as f:
            for line in f:
                if line.startswith("VmHWM"):
                    return int(line.split()[1]) // 1024
        return 0

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0

    def __enter__(self):
        return self

    def __exit__(self, *_):
        # A run that failed midway leaves no gateway behind.
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def fresh_dir(name):
    path = os.path.join(WORK, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def put(workdir, build):
    """Replaces workdir/plugin.wasm by rename; returns when."""
    temporary = os.path.join(workdir, ".plugin.wasm.tmp")
    shutil.copy(build, temporary)
    now = time.monotonic()
    os.rename(temporary, os.path.join(workdir, "plugin.wasm"))
    return now


def wait_serving(gateway, sha, since):
    while True:
        status = gateway.status()
        if status["plugin"]["sha256"] == sha:
            return time.monotonic() - since, status["plugin"]["compiled"]
        assert time.monotonic() - since < 120, "no reload to %s within 120 s: %s" % (sha, status)
        time.sleep(0.005)


def starts(builds, rounds):
    workdir = fresh_dir("starts")
    shutil.copy(builds["A"][0], os.path.join(workdir, "plugin.wasm"))
    cache = os.path.join(workdir, "cache")
    results = {"without": [], "with": []}
    # The first start with the cache compiles and stores build A.
    with Gateway(workdir, cache) as gateway:
        gateway.stop()
    for _ in range(rounds):
        for mode in ("without", "with"):
            with Gateway(workdir, cache if mode == "with" else None) as gateway:
                compiled = gateway.status()["plugin"]["compiled"]
                assert compiled == ("cache" if mode == "with" else "now"), compiled
                gateway.assert_stamps()
                results[mode].append((gateway.start_seconds, gateway.peak_rss_mib()))
                gateway.stop()
    return results


def reloads(builds, rounds):
    results = {}
    for mode in ("without", "with"):
        workdir = fresh_dir("reloads-" + mode)
        shutil.copy(builds["A"][0], os.path.join(workdir, "plugin.wasm"))
        with Gateway(workdir, os.path.join(workdir, "cache") if mode == "with" else None) as gateway:
            # The first swap to B compiles B (and stores it, with the cache).
            wait_serving(gateway, builds["B"][1], put(workdir, builds["B"][0]))
            times = []
            for _ in range(rounds):
                seconds, compiled = wait_serving(gateway, builds["A"][1], put(workdir, builds["A"][0]))
                assert compiled == ("cache" if mode == "with" else "now"), compiled
                gateway.assert_stamps()
                times.append(seconds)
                wait_serving(gateway, builds["B"][1], put(workdir, builds["B"][0]))
            gateway.stop()
        results[mode] = times
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--snowgate", default=SNOWGATE,
                        help="the binary to measure (default target/release/snowgate)")
    args = parser.parse_args()
    global SNOWGATE_BINARY
    SNOWGATE_BINARY = args.snowgate
    if not os.path.exists(SNOWGATE_BINARY):
        sys.exit("no %s: run cargo build --release first" % SNOWGATE_BINARY)
    os.makedirs(WORK, exist_ok=True)
    builds = build_plugins()
    start_results = starts(builds, args.rounds)
    reload_results = reloads(builds, args.rounds)
    print("\n| | without the cache | with the cache | ratio |\n|---|---:|---:|---:|")
    without = statistics.median(s for s, _ in start_results["without"])
    cached = statistics.median(s for s, _ in start_results["with"])
    print("| start to ready line, median of %d | %.3f s | %.3f s | %.0fx |" % (args.rounds, without, cached, without / cached))
    without_rss = statistics.median(r for _, r in start_results["without"])
    cached_rss = statistics.median(r for _, r in start_results["with"])
    print("| peak RSS after start and one request | %d MiB | %d MiB | |" % (without_rss, cached_rss))
    without = statistics.median(reload_results["without"])
    cached = statistics.median(reload_results["with"])
    print("| reload back to a build served before, median of %d | %.3f s | %.3f s | %.0fx |" % (args.rounds, without, cached, without / cached))
    print("\neach run: starts %s; reloads %s" % (
        {m: ["%.3f s, %d MiB" % r for r in v] for m, v in start_results.items()},
        {m: ["%.3f s" % t for t in v] for m, v in reload_results.items()}))


if __name__ == "__main__":
    main()
