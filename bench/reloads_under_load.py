#!/usr/bin/env python3
"""Resident memory of the gateway across many plugin reloads while it serves.

    python3 bench/reloads_under_load.py                  # 1000 reloads under wrk load
    python3 bench/reloads_under_load.py --reloads 300 --sample-every 25

`cargo bench -p snowgate-host --bench reloads` measures reloads in a process that serves
nothing. This script measures the real binary while it serves: nginx `return 200` as the
upstream, `target/release/snowgate serve --plugin FILE` in front of it, and wrk sending 1 KiB
context-only requests the whole time. In order:

  1. load alone for --settle seconds (the instances, connections and allocator warm up);
  2. --reloads reloads under the same load: each writes a new build (the plugin with a custom
     section appended, so a new SHA-256), renames it over FILE, POSTs /reload and checks that
     /status serves it; RSS is sampled every --sample-every reloads;
  3. load alone again for as long as phase 2 took (what the load does to RSS by itself);
  4. idle for --idle seconds, no load.

Reports RSS (and its anonymous and shared parts, from /proc/PID/smaps_rollup), the threads,
the wasm memory images still mapped (memfd mappings), the requests served and their status
codes, and the ids stamped, and writes bench/results/reloads-under-load.{json,md}. The growth
that matters is phase 2 against phase 3: memory the reloads keep, not memory the load uses.

Needs nginx, wrk and a release build. Python standard library only.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load  # noqa: E402  (the side-by-side load benchmark: process and nginx helpers)

ROOT = load.ROOT
HOST = load.HOST


def custom_section(n: int) -> bytes:
    """A wasm custom section named `snowgate-variant` holding N: appended to a component it
    changes the bytes (and so the SHA-256) and nothing else."""
    name = b"snowgate-variant"
    payload = n.to_bytes(4, "little")
    size = 1 + len(name) + len(payload)
    return bytes([0, size, len(name)]) + name + payload


def smaps(pid: int) -> dict[str, int]:
    """RSS and its parts, in KiB, from /proc/PID/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            m = re.match(r"(\w+):\s+(\d+) kB", line)
            if m and m.group(1) in ("Rss", "Anonymous", "Shared_Clean", "Shared_Dirty",
                                    "Private_Clean", "Private_Dirty", "Swap"):
                out[m.group(1)] = int(m.group(2))
    return out


def memfd_mappings(pid: int) -> int:
    """How many distinct memfd files the process maps: each loaded plugin build maps its
    initial memory image from one (wasmtime's copy-on-write images)."""
    files = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/memfd:"):
                files.add(parts[4])  # inode
    return len(files)


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


class Run:
    def __init__(self, args):
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="snowgate-reloads-")
        os.chmod(self.tmp, 0o755)
        self.snowgate = load.private_copy(args.snowgate, self.tmp)
        with open(args.plugin, "rb") as f:
            self.plugin = f.read()
        self.plugin_file = os.path.join(self.tmp, "plugin.wasm")
        self.install(0)
        self.samples: list[dict] = []
        self.started = time.monotonic()

    def install(self, n: int) -> None:
        tmp = os.path.join(self.tmp, ".plugin.wasm.tmp")
        with open(tmp, "wb") as f:
            f.write(self.plugin + custom_section(n))
        os.rename(tmp, self.plugin_file)

    def start(self) -> None:
        self.up_port = load.free_port()
        user_line = "user root root;" if os.geteuid() == 0 else ""
        prefix = os.path.join(self.tmp, "upstream")
        for d in ("tmp", "logs"):
            os.makedirs(os.path.join(prefix, d), exist_ok=True)
        conf = load.nginx_common(prefix, user_line, "") + f"""
    server {{
        listen {HOST}:{self.up_port} reuseport backlog=4096;
        location / {{ return 200 '{{"ok":true}}\\n'; }}
    }}
}}
"""
        conf_path = os.path.join(prefix, "nginx.conf")
        with open(conf_path, "w") as f:
            f.write(conf)
        nginx = [self.args.nginx, "-p", prefix, "-c", conf_path, "-e", f"{prefix}/error.log"]
        proc = load.start(nginx, os.path.join(prefix, "stdout.log"))
        load.wait_ready(f"http://{HOST}:{self.up_port}/", proc, f"{prefix}/error.log")

        self.port, self.admin = load.free_port(), load.free_port()
        cmd = [self.snowgate, "serve", "--listen", f"{HOST}:{self.port}",
               "--admin-listen", f"{HOST}:{self.admin}",
               "--upstream", f"http://{HOST}:{self.up_port}",
               "--machine-id", "1", "--plugin", self.plugin_file]
        self.command = " ".join(cmd)
        log = os.path.join(self.tmp, "snowgate.log")
        self.gateway = load.start(cmd, log)
        load.wait_ready(f"http://{HOST}:{self.admin}/readyz", self.gateway, log)

        body = load.make_bodies()["1KiB"]
        body_file = os.path.join(self.tmp, "body.json")
        with open(body_file, "wb") as f:
            f.write(body)
        self.script = os.path.join(self.tmp, "wrk.lua")
        with open(self.script, "w") as f:
            f.write(load.WRK_SCRIPT % (load.PATH, "application/json", body_file, ""))

    def wrk(self, seconds: float) -> subprocess.Popen:
        cmd = [self.args.wrk, "-t1", f"-c{self.args.connections}", f"-d{int(seconds) + 1}s",
               "-s", self.script, f"http://{HOST}:{self.port}{load.PATH}"]
        self.wrk_command = " ".join(cmd)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        load._started.append(proc)
        return proc

    def end_wrk(self, proc: subprocess.Popen) -> dict:
        proc.send_signal(signal.SIGINT)  # wrk prints its summary on SIGINT
        out = proc.communicate(timeout=60)[0]
        load._started.remove(proc)
        requests = re.search(r"(\d+) requests in", out)
        non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        errors = re.search(r"Socket errors: (.*)", out)
        return {"requests": int(requests.group(1)) if requests else None,
                "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
                "socket_errors": errors.group(1).strip() if errors else "none",
                "output": out}

    def metric(self, name: str) -> float:
        _, body = load.http("GET", f"http://{HOST}:{self.admin}/metrics")
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.split()[-1])
        return total

    def sample(self, phase: str, reloads: int) -> dict:
        pid = self.gateway.pid
        if self.gateway.poll() is not None:
            sys.exit(f"the gateway exited with {self.gateway.returncode} during {phase}")
        s = {"phase": phase, "t": round(time.monotonic() - self.started, 1), "reloads": reloads,
             **smaps(pid), "threads": threads(pid), "memfd_images": memfd_mappings(pid),
             "ids_stamped": self.metric("snowgate_ids_stamped_total")}
        self.samples.append(s)
        print(f"  {phase:<8} t={s['t']:>6.1f}s reloads={reloads:>5} RSS={s['Rss']:>7} KiB "
              f"anon={s['Anonymous']:>7} threads={s['threads']} images={s['memfd_images']}",
              flush=True)
        return s

    def reload(self, n: int) -> None:
        self.install(n)
        status, body = load.http("POST", f"http://{HOST}:{self.admin}/reload", timeout=30)
        if status != 200:
            sys.exit(f"reload {n} failed with {status}: {body[:500]!r}")
        _, status_doc = load.http("GET", f"http://{HOST}:{self.admin}/status")
        served = json.loads(status_doc)["plugin"]["sha256"]
        expected = json.loads(body)["sha256"]
        if served != expected:
            sys.exit(f"after reload {n}, /status serves {served}, not {expected}")

    def timed_load(self, phase: str, seconds: float, every: float, reloads: int) -> None:
        end = time.monotonic() + seconds
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(every, left))
            self.sample(phase, reloads)

    def main(self) -> dict:
        a = self.args
        self.start()
        self.sample("start", 0)
        # wrk runs through phases 1-3; it is stopped with SIGINT at the end of phase 3.
        wrk = self.wrk(a.settle + 3600 * 4)
        self.timed_load("settle", a.settle, 10, 0)
        reload_start = time.monotonic()
        for n in range(1, a.reloads + 1):
            self.reload(n)
            if n % a.sample_every == 0:
                self.sample("reloads", n)
        reload_seconds = time.monotonic() - reload_start
        self.timed_load("load", reload_seconds, max(10.0, reload_seconds / 20), a.reloads)
        served = self.end_wrk(wrk)
        self.timed_load("idle", a.idle, 10, a.reloads)
        by_phase = {}
        for s in self.samples:
            by_phase.setdefault(s["phase"], []).append(s)
        settle_end = by_phase["settle"][-1]["Rss"]
        reloads_end = by_phase["reloads"][-1]["Rss"]
        load_end = by_phase["load"][-1]["Rss"]
        return {
            "reloads": a.reloads,
            "reload_seconds": round(reload_seconds, 1),
            "per_reload_ms": round(1000 * reload_seconds / a.reloads, 1),
            "rss_kib": {"after_settle": settle_end, "after_reloads": reloads_end,
                        "after_as_long_again_without_reloads": load_end,
                        "idle_end": by_phase["idle"][-1]["Rss"],
                        "max": max(s["Rss"] for s in self.samples)},
            "served": {k: v for k, v in served.items() if k != "output"},
            "wrk_output": served["output"],
            "samples": self.samples,
            "commands": {"gateway": self.command, "load": self.wrk_command},
        }


def markdown(r: dict) -> str:
    rss = r["rss_kib"]
    lines = [
        "# RSS across plugin reloads under load (bench/reloads_under_load.py)",
        "",
        f"{r['reloads']} reloads in {r['reload_seconds']} s ({r['per_reload_ms']} ms each, "
        "rename + POST /reload + /status check) while wrk sent 1 KiB context-only requests.",
        "",
        "| point | RSS (KiB) |",
        "|---|---|",
        f"| after the load alone settled | {rss['after_settle']:,} |",
        f"| after {r['reloads']} reloads under load | {rss['after_reloads']:,} |",
        f"| after as long again under load, no reloads | "
        f"{rss['after_as_long_again_without_reloads']:,} |",
        f"| idle, at the end | {rss['idle_end']:,} |",
        f"| highest sample | {rss['max']:,} |",
        "",
        f"Requests: {r['served']['requests']}, non-2xx {r['served']['non_2xx']}, socket errors "
        f"{r['served']['socket_errors']}.",
        "",
        "| phase | t (s) | reloads | RSS | anonymous | threads | memfd images | ids stamped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in r["samples"]:
        lines.append(f"| {s['phase']} | {s['t']} | {s['reloads']} | {s['Rss']:,} | "
                     f"{s['Anonymous']:,} | {s['threads']} | {s['memfd_images']} | "
                     f"{int(s['ids_stamped']):,} |")
    lines += ["", "Commands:", "", "```sh", r["commands"]["gateway"], r["commands"]["load"],
              "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reloads", type=int, default=1000)
    ap.add_argument("--sample-every", type=int, default=50, metavar="N",
                    help="sample RSS every N reloads (default 50)")
    ap.add_argument("--settle", type=float, default=30, metavar="SECONDS",
                    help="load alone before the first reload (default 30)")
    ap.add_argument("--idle", type=float, default=30, metavar="SECONDS",
                    help="idle time after the load, sampled every 10 s (default 30)")
    ap.add_argument("--connections", type=int, default=32, help="wrk -c (default 32)")
    ap.add_argument("--snowgate", default=os.path.join(ROOT, "target/release/snowgate"))
    ap.add_argument("--plugin", default=os.path.join(
        ROOT, "target/wasm32-wasip2/release/snowgate_plugin.wasm"))
    ap.add_argument("--nginx", default=load.find_nginx())
    ap.add_argument("--wrk", default=shutil.which("wrk"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results"))
    args = ap.parse_args()
    for tool, install in (("nginx", "apt-get install nginx"), ("wrk", "apt-get install wrk")):
        if not getattr(args, tool):
            sys.exit(f"{tool} not found: {install}")
    for path in (args.snowgate, args.plugin):
        if not os.path.exists(path):
            sys.exit(f"{path} not found: cargo build --release --locked")
    signal.signal(signal.SIGTERM, load._on_signal)
    signal.signal(signal.SIGINT, load._on_signal)
    run = Run(args)
    # atexit runs the last registered first: stop the processes, then remove their directory
    atexit.register(lambda: shutil.rmtree(run.tmp, ignore_errors=True))
    atexit.register(load._stop_all)
    result = run.main()
    text = markdown(result)
    load.write_report(args.out, "reloads-under-load", result, text)
    print(text)


if __name__ == "__main__":
    main()
