"""Two environments of one snowgate binary, driven side by side: throughput, CPU and memory.

The machinery behind bench/huge_pages.py and bench/purge_delay.py, which each name two
variants (an environment for `snowgate serve`) and call `compare`. It starts one gateway per
variant from the same binary behind one nginx `return 200` upstream, and drives both at the
same time, each with a wrk -t1 -c32 of its own, on load.py's 1 KiB and 64 KiB context-only
requests: on a shared VM whose speed swings by a third between runs, two runs at once see the
same machine, and the gateway whose requests cost more CPU gets fewer. After every run it reads
each gateway's RSS and CPU time. Prints the median requests per second of each, the median of
the rounds' ratios, the CPU time per request, and the median and highest RSS, and writes a
Markdown table under bench/results/.

Needs nginx, wrk and a release build. Python standard library only.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load  # noqa: E402  (the side-by-side load benchmark: process and nginx helpers)

HOST = load.HOST


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def arguments(doc: str) -> argparse.Namespace:
    """The options every comparison takes."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", default="10s", help="wrk -d per run (default 10s)")
    ap.add_argument("--snowgate", default=os.path.join(load.ROOT, "target/release/snowgate"))
    ap.add_argument("--out", default=os.path.join(load.ROOT, "bench/results"))
    return ap.parse_args()


def compare(args: argparse.Namespace, variants: dict[str, dict[str, str]], title: str,
            out_file: str, preamble: Callable[[], str] = lambda: "",
            flags: Callable[[str, str], list[str]] = lambda name, tmp: []) -> None:
    """Runs `args.rounds` rounds of both variants at once and writes `out_file`.

    `variants` maps a name to the environment its gateway gets on top of this one's; the first
    is the baseline of the ratio. `flags(name, tmp)` gives a variant's extra `snowgate serve`
    flags (`tmp` is the run's scratch directory). `preamble` gives a line of context for the
    table (read after the runs).
    """
    if len(variants) != 2:
        sys.exit("compare takes exactly two variants")
    first, second = variants
    nginx, wrk = load.find_nginx(), shutil.which("wrk")
    if not nginx or not wrk:
        sys.exit("needs nginx and wrk: apt-get install nginx wrk")
    signal.signal(signal.SIGTERM, load._on_signal)
    signal.signal(signal.SIGINT, load._on_signal)
    tmp = tempfile.mkdtemp(prefix="snowgate-variants-")
    # atexit runs the last registered first: stop the processes, then remove their directory
    atexit.register(lambda: shutil.rmtree(tmp, ignore_errors=True))
    atexit.register(load._stop_all)
    os.chmod(tmp, 0o755)
    snowgate = load.private_copy(args.snowgate, tmp)

    up = load.free_port()
    prefix = os.path.join(tmp, "upstream")
    for d in ("tmp", "logs"):
        os.makedirs(os.path.join(prefix, d), exist_ok=True)
    user_line = "user root root;" if os.geteuid() == 0 else ""
    with open(f"{prefix}/nginx.conf", "w") as f:
        f.write(load.nginx_common(prefix, user_line, "") + f"""
    server {{
        listen {HOST}:{up} reuseport backlog=4096;
        location / {{ return 200 '{{"ok":true}}\\n'; }}
    }}
}}
""")
    proc = load.start([nginx, "-p", prefix, "-c", f"{prefix}/nginx.conf", "-e",
                       f"{prefix}/error.log"], f"{prefix}/stdout.log")
    load.wait_ready(f"http://{HOST}:{up}/", proc, f"{prefix}/error.log")

    gateways = {}
    for name, env in variants.items():
        port, admin = load.free_port(), load.free_port()
        log = os.path.join(tmp, f"{name}.log")
        proc = load.start([snowgate, "serve", "--listen", f"{HOST}:{port}", "--admin-listen",
                           f"{HOST}:{admin}", "--upstream", f"http://{HOST}:{up}",
                           "--machine-id", "1"] + flags(name, tmp), log,
                          env=dict(os.environ, **env))
        load.wait_ready(f"http://{HOST}:{admin}/readyz", proc, log)
        gateways[name] = (port, proc)

    files = load.write_bodies(tmp, load.make_bodies())

    def wrk_cmd(name: str, body: str, duration: str) -> list[str]:
        script = os.path.join(tmp, f"wrk-{body}.lua")
        with open(script, "w") as f:
            f.write(load.WRK_SCRIPT % (load.PATH, "application/json", files[body], ""))
        return [wrk, "-t1", "-c32", f"-d{duration}", "--latency", "-s", script,
                f"http://{HOST}:{gateways[name][0]}{load.PATH}"]

    def drive_both(body: str, duration: str) -> dict:
        """Both gateways at once, each by a wrk of its own: whatever the machine does to one
        run (another VM's load, a busy core) it does to both."""
        cpu = {n: load.proc_cpu_ticks(gateways[n][1].pid) for n in variants}
        procs = {n: subprocess.Popen(wrk_cmd(n, body, duration), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True) for n in variants}
        out = {n: p.communicate(timeout=600)[0] for n, p in procs.items()}
        results = {}
        for n in variants:
            res = load.parse_wrk(out[n])
            if res["rps"] is None or res["non_2xx"] or res["socket_errors"]:
                sys.exit(f"wrk against {n} failed or saw errors:\n{out[n]}")
            ticks = load.proc_cpu_ticks(gateways[n][1].pid) - cpu[n]
            res["cpu_us_per_request"] = ticks / os.sysconf("SC_CLK_TCK") * 1e6 / res["requests"]
            results[n] = res
        return results

    for body in files:
        drive_both(body, "3s")
    runs = {(name, body): [] for name in variants for body in files}
    ratios = {body: [] for body in files}
    rss = {name: [] for name in variants}
    width = max(map(len, variants))
    for r in range(args.rounds):
        for body in files:
            both = drive_both(body, args.duration)
            ratios[body].append(both[first]["rps"] / both[second]["rps"])
            for name, res in both.items():
                runs[(name, body)].append(res)
                rss[name].append(rss_kib(gateways[name][1].pid))
                print(f"round {r} {name:<{width}} {body:<6} {res['rps']:>10.0f} req/s "
                      f"p99 {res['p99_us']:>8.0f} us  CPU {res['cpu_us_per_request']:.1f} us/req"
                      f"  RSS {rss[name][-1]} KiB", flush=True)

    context = preamble()
    lines = [f"# {title}", "",
             (f"{context} " if context else "")
             + f"{args.rounds} rounds per body, both gateways driven at once by wrk -t1 -c32 "
             f"-d{args.duration} each; medians.",
             "", f"| body | {first} req/s | {second} req/s | {first}/{second} (median of the "
             f"rounds' ratios) | {first} CPU per request | {second} CPU per request |",
             "|---|---|---|---|---|---|"]
    for body in files:
        med = {n: statistics.median(x["rps"] for x in runs[(n, body)]) for n in variants}
        cpu = {n: statistics.median(x["cpu_us_per_request"] for x in runs[(n, body)])
               for n in variants}
        lines.append(f"| {body} | {med[first]:,.0f} | {med[second]:,.0f} | "
                     f"{statistics.median(ratios[body]):.2f}x | {cpu[first]:.1f} us | "
                     f"{cpu[second]:.1f} us |")
    lines += ["", "| variant | RSS after each run, median | highest |", "|---|---|---|"]
    for name in variants:
        lines.append(f"| {name} | {statistics.median(rss[name]):,.0f} KiB | "
                     f"{max(rss[name]):,} KiB |")
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, out_file), "w") as f:
        f.write(text)
    print(text)
