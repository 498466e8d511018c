#!/usr/bin/env python3
"""The latency the plugin adds to a request, with the gateway on a CPU of its own.

    python3 bench/added_latency.py                 # 1 KiB and 64 KiB, 5 rounds x 10 s
    python3 bench/added_latency.py --rounds 3 --duration 5s --body 1KiB

bench/load.py runs the load tool, the upstream and the servers on the same 2 CPUs, so its
end-to-end p99 at half of peak mostly says how long a request waited for a CPU that another
process held. This script takes that contention out of the gateway, as one would when
deploying one:

  CPU 0   nginx (one worker), the upstream: it reads each request's whole body, then answers
          200 at once; and the load tool (oha)
  CPU 1   one snowgate (`--workers 1`), the only process of the run there (taskset pins
          these processes; it keeps nothing else off CPU 1, so run this on an idle machine)

and compares the two paths of that one gateway process under the same load at the same time:
two oha processes run at once, one sending `application/json` bodies, which go through the
plugin, the other the same bytes as `text/plain`, which stream through without it. Whatever
stalls one stream (the load tool's own CPU, the host taking the VM's CPUs away) stalls the
other too, so the difference between their latencies is what the plugin adds. Both run at the
same fixed rate, chosen so that CPU 1 is about half busy: closed-loop runs first measure the
gateway's CPU time per request on each path, the rate is 0.5 / (their sum), and a short trial
run at that rate scales it by 50 % / CPU 1's busy share in the trial (/proc/stat, softirq
time included).

Reports, per body and round, the p50 and p99 of each path (oha, open loop,
`--latency-correction`), the p99 added by the plugin (plugin minus pass-through in the same
round; the summary is the median over the quiet rounds), the plugin call's own p99 as the
gateway times it (`snowgate_plugin_call_seconds`; the summary is the worst quiet round's bucket
bound), and the steal time of each CPU (/proc/stat): a round in which the hypervisor took more
than --max-steal % of a CPU is not quiet, as its tail is the host's, and is left out of the
summary. Writes bench/results/added-latency.{json,md}.

Needs nginx with the Lua module (the upstream of bench/load.py), oha (on PATH or /opt/oha/bin),
taskset, at least 2 CPUs, and a built target/release/snowgate. Python standard library only.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as _dt
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # no bench/__pycache__ from importing the sibling below
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load  # noqa: E402  (the sibling benchmark: its processes, bodies and nginx upstream)

ROOT = load.ROOT
HOST = load.HOST
GATEWAY_CPU = "1"
OTHERS_CPU = "0"
GATEWAY_CORE = "cpu" + GATEWAY_CPU  # its name in /proc/stat
PATHS = {"plugin": "application/json", "pass-through": "text/plain"}
READ_THEN_ANSWER = """location / {
            content_by_lua_block {
                ngx.req.read_body()
                ngx.print('{"ok":true}\\n')
            }
        }"""


class Run:
    def __init__(self, args):
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="snowgate-latency-")
        os.chmod(self.tmp, 0o755)
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.bodies = {k: v for k, v in load.make_bodies().items()
                       if not args.body or k in args.body}
        self.body_files = load.write_bodies(self.tmp, self.bodies)
        self.snowgate = load.private_copy(args.snowgate, self.tmp)
        self.commands: dict[str, str] = {}

    def start(self) -> None:
        a = self.args
        self.up_port, self.port, self.admin = load.free_port(), load.free_port(), load.free_port()
        prefix = os.path.join(self.tmp, "upstream")
        for d in ("tmp", "logs"):
            os.makedirs(os.path.join(prefix, d), exist_ok=True)
        modules = (f"load_module {a.nginx_modules}/ndk_http_module.so;\n"
                   f"load_module {a.nginx_modules}/ngx_http_lua_module.so;")
        user_line = "user root root;" if os.geteuid() == 0 else ""
        conf = load.nginx_upstream_conf(prefix, self.up_port, user_line, modules).replace(
            "worker_processes auto;", "worker_processes 1;")
        # An inference server reads the whole request before it answers; `return 200` answers
        # at once and discards the body as it comes, which would let a streamed request's
        # answer overtake its own body, and the plugin path (which reads the body before its
        # call) look slower by the body's transfer time.
        answer_at_once = "location / { return 200 '{\"ok\":true}\\n'; }"
        if answer_at_once not in conf:
            sys.exit("bench/load.py's upstream configuration changed: update added_latency.py")
        conf = conf.replace(answer_at_once, READ_THEN_ANSWER)
        conf_path = os.path.join(prefix, "nginx.conf")
        with open(conf_path, "w") as f:
            f.write(conf)
        up_cmd = ["taskset", "-c", OTHERS_CPU, a.nginx, "-p", prefix, "-c", conf_path,
                  "-e", f"{prefix}/error.log"]
        self.upstream = load.start(up_cmd, os.path.join(prefix, "stdout.log"))
        self.commands["upstream"] = load.sh_quote(up_cmd) + ("   # bench/load.py's upstream, 1 worker, "
                                                         "reading each body before it answers")
        load.wait_ready(f"http://{HOST}:{self.up_port}/", self.upstream,
                        os.path.join(prefix, "error.log"))
        sg_cmd = ["taskset", "-c", GATEWAY_CPU, self.snowgate, "serve",
                  "--listen", f"{HOST}:{self.port}", "--admin-listen", f"{HOST}:{self.admin}",
                  "--upstream", f"http://{HOST}:{self.up_port}",
                  "--machine-id", str(load.MACHINE_ID), "--workers", "1"]
        log = os.path.join(self.tmp, "snowgate.log")
        self.gateway = load.start(sg_cmd, log)
        self.commands["snowgate"] = load.sh_quote(
            [os.path.relpath(a.snowgate, ROOT) if c == self.snowgate else c for c in sg_cmd])
        load.wait_ready(f"http://{HOST}:{self.admin}/readyz", self.gateway, log)
        self.check()

    def check(self) -> None:
        """The plugin path stamps an id into each body; the pass-through path calls no plugin."""
        before = (self.counter("snowgate_plugin_call_seconds_count"),
                  self.counter("snowgate_ids_stamped_total"))
        for name, body in self.bodies.items():
            for path, ctype in PATHS.items():
                status, _ = load.http("POST", f"http://{HOST}:{self.port}{load.PATH}", body, ctype)
                if status != 200:
                    sys.exit(f"the gateway answered {status} to the {name} body as {ctype}")
        calls = self.counter("snowgate_plugin_call_seconds_count") - before[0]
        stamped = self.counter("snowgate_ids_stamped_total") - before[1]
        if calls != len(self.bodies) or stamped != len(self.bodies):
            sys.exit(f"the check sent {len(self.bodies)} bodies down each path: expected as many "
                     f"plugin calls and ids, counted {calls:.0f} calls and {stamped:.0f} ids")

    def metrics(self) -> str:
        _, body = load.http("GET", f"http://{HOST}:{self.admin}/metrics")
        return body.decode()

    def counter(self, name: str) -> float:
        """The sum of a metric's samples, over all its labels."""
        return sum(float(line.split()[-1]) for line in self.metrics().splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))

    def histogram(self) -> list[tuple[float, float]]:
        return load.plugin_call_histogram(self.metrics())

    def oha_cmd(self, body: str, path: str, duration: str, rate: float | None,
                connections: int) -> list[str]:
        # -w: requests in flight at the deadline are waited for, not aborted
        cmd = ["taskset", "-c", OTHERS_CPU, self.args.oha, "-z", duration, "-w", "-c",
               str(connections), "--no-tui", "--output-format", "json", "-m", "POST",
               "-T", PATHS[path], "-D", self.body_files[body]]
        if rate is not None:
            cmd += ["-q", f"{rate:.0f}", "--latency-correction"]
        cmd.append(f"http://{HOST}:{self.port}{load.PATH}")
        self.commands[f"oha {body} {path} {'fixed rate' if rate else 'closed loop'}"] = load.sh_quote(
            [c if c != self.body_files[body] else f"BODY-{body}.json" for c in cmd])
        return cmd

    def drive(self, cmds: dict[str, list[str]], seconds: float) -> dict:
        """Runs the oha commands at once; returns each one's latencies, and what the
        gateway's process and each CPU did meanwhile."""
        hist_before = self.histogram()
        cpu_before, cpus_before = load.proc_cpu_ticks(self.gateway.pid), cpu_ticks()
        wall_before = time.monotonic()
        procs = {}
        try:
            for k, c in cmds.items():
                procs[k] = subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True, start_new_session=True)
                load._started.append(procs[k])  # stopped on exit if the run is interrupted
            outs = {k: p.communicate(timeout=seconds + 60) for k, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                load._started.remove(p)
        wall = time.monotonic() - wall_before
        cpu = (load.proc_cpu_ticks(self.gateway.pid) - cpu_before) / self.ticks
        cpus_after = cpu_ticks()
        res, answered = {}, 0
        for k, (stdout, stderr) in outs.items():
            if procs[k].returncode != 0:
                sys.exit(f"{load.sh_quote(cmds[k])} failed ({procs[k].returncode}):\n{stderr}")
            data = json.loads(stdout[stdout.index("{"):])
            pct, codes = data.get("latencyPercentiles", {}), data.get("statusCodeDistribution", {})
            failed = (sum(codes.values()) - codes.get("200", 0)
                      + sum(data.get("errorDistribution", {}).values()))
            if failed:
                sys.exit(f"{failed} requests failed or were not answered 200 in "
                         f"{load.sh_quote(cmds[k])}: {codes} {data.get('errorDistribution')}")
            if any(pct.get(q) is None for q in ("p50", "p99", "p99.9")):
                sys.exit(f"oha reported no latencies (no request answered?) in "
                         f"{load.sh_quote(cmds[k])}:\n{stdout[-2000:]}")
            answered += sum(codes.values())
            res[k] = {"rps": data["summary"]["requestsPerSec"], "p50_us": pct["p50"] * 1e6,
                      "p99_us": pct["p99"] * 1e6, "p99_9_us": pct["p99.9"] * 1e6}
        res["gateway_cpu_us_per_request"] = 1e6 * cpu / answered
        # the gateway's own user and system time; the CPUs' busy shares (from /proc/stat)
        # also hold softirq time and anything else that ran there
        res["gateway_core_busy_pct"] = 100.0 * cpu / wall
        res["cpu_busy_pct"] = {n: share(cpus_before[n], cpus_after[n], "busy")
                               for n in cpus_after}
        res["steal_pct"] = {n: share(cpus_before[n], cpus_after[n], "steal")
                            for n in cpus_after}
        res.update(load.Bench.histogram_quantiles(hist_before, self.histogram()))
        return res

    def body(self, name: str) -> dict:
        a = self.args
        seconds = load.parse_duration_us(a.duration) / 1e6
        peak_seconds = load.parse_duration_us(a.peak_duration) / 1e6
        # what each path costs the gateway's core, from a closed-loop run of each
        closed = {path: self.drive({path: self.oha_cmd(name, path, a.peak_duration, None,
                                                       a.peak_connections)}, peak_seconds)
                  for path in PATHS}
        cost = sum(closed[p]["gateway_cpu_us_per_request"] for p in PATHS)
        # both streams at this rate would keep CPU 1 half busy; at a fixed rate a request
        # costs more than in a closed loop (fewer requests share each wake-up), so one short
        # run at that rate corrects it
        rate = 0.5 * 1e6 / cost
        trial = self.drive({p: self.oha_cmd(name, p, a.peak_duration, rate, a.connections)
                            for p in PATHS}, peak_seconds)
        rate *= 50.0 / max(1.0, trial["cpu_busy_pct"][GATEWAY_CORE])
        print(f"{name}: closed loop, µs of the gateway's core a request: "
              + ", ".join(f"{p} {closed[p]['gateway_cpu_us_per_request']:.1f} "
                          f"({closed[p][p]['rps']:,.0f} req/s)" for p in PATHS)
              + f"; fixed rate {rate:,.0f} req/s on each path at once")
        rounds = []
        for rnd in range(1, a.rounds + 1):
            r = self.drive({p: self.oha_cmd(name, p, a.duration, rate, a.connections)
                            for p in PATHS}, seconds)
            r["round"] = rnd
            r["p99_added_us"] = r["plugin"]["p99_us"] - r["pass-through"]["p99_us"]
            r["p50_added_us"] = r["plugin"]["p50_us"] - r["pass-through"]["p50_us"]
            r["quiet"] = max(r["steal_pct"].values()) <= a.max_steal
            rounds.append(r)
            print(f"  round {rnd}: " + "; ".join(
                f"{p} {r[p]['rps']:,.0f} req/s p50 {r[p]['p50_us']:,.0f} p99 "
                f"{r[p]['p99_us']:,.0f} µs" for p in PATHS)
                + f"; p99 added {r['p99_added_us']:,.0f} µs; core "
                f"{r['cpu_busy_pct'][GATEWAY_CORE]:.0f} % busy "
                f"({r['gateway_core_busy_pct']:.0f} % the gateway's own); call p99 ≤ "
                f"{r['plugin_call_p99_at_most_us']} µs; steal "
                + ", ".join(f"{n} {v:.1f} %" for n, v in r["steal_pct"].items())
                + ("" if r["quiet"] else " (not quiet: left out of the medians)"))
        used = [r for r in rounds if r["quiet"]]
        out = {"closed_loop": closed, "trial_at_closed_loop_cost": trial,
               "rate_rps_each": rate, "rounds": rounds,
               "quiet_rounds": len(used)}
        if used:
            out["median"] = {p: {k: statistics.median(r[p][k] for r in used)
                                 for k in ("rps", "p50_us", "p99_us", "p99_9_us")}
                             for p in PATHS}
            out["p99_added_by_plugin_us"] = statistics.median(r["p99_added_us"] for r in used)
            out["p50_added_by_plugin_us"] = statistics.median(r["p50_added_us"] for r in used)
            bounds = [r["plugin_call_p99_at_most_us"] for r in used
                      if r["plugin_call_p99_at_most_us"] is not None]
            out["plugin_call_p99_at_most_us"] = ("inf" if "inf" in bounds
                                                 else max(bounds, default=None))
        return out


def cpu_ticks() -> dict[str, dict[str, int]]:
    """Each CPU's ticks since boot: all, busy (neither idle nor stolen) and steal (see
    load.cpu_stat_ticks)."""
    out = {}
    for name, vals in load.cpu_stat_ticks().items():
        if name != "cpu":
            total = sum(vals)
            out[name] = {"all": total, "steal": vals[7],
                         "busy": total - vals[3] - vals[4] - vals[7]}
    return out


def share(before: dict[str, int], after: dict[str, int], kind: str) -> float:
    """The share of a CPU's ticks between two readings that were of `kind`, in %."""
    return 100.0 * (after[kind] - before[kind]) / max(1, after["all"] - before["all"])


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"Run {result['generated_at']}: `{result['command']}`; {result['machine']}. "
             f"Gateway pinned to CPU {GATEWAY_CPU} (`--workers 1`); upstream (nginx, 1 worker) and "
             f"the two oha processes on CPU {OTHERS_CPU}. Each round drives both paths at once, "
             f"each at the same fixed rate (oha -c {s['connections']} --latency-correction, "
             f"{s['duration']}), {s['rounds']} rounds; a round with more than {s['max_steal']} % "
             "steal on a CPU is left out of the medians.", ""]
    for name, b in result["bodies"].items():
        cl = b["closed_loop"]
        lines += [f"**{name}**: the gateway's core spends "
                  + " and ".join(f"{cl[p]['gateway_cpu_us_per_request']:.1f} µs a request "
                                 f"{'through the plugin' if p == 'plugin' else 'streamed through'}"
                                 for p in PATHS)
                  + f" (closed loop); fixed rate {b['rate_rps_each']:,.0f} req/s on each path, "
                  "so that its CPU is about half busy (set from those costs, then corrected "
                  "by a trial run at that rate).", "",
                  "| round | plugin p50 | plugin p99 | pass-through p50 | pass-through p99 | "
                  "p99 added | call p99 at most | gateway's CPU busy (the gateway's own time) "
                  "| steal (CPU 0, 1) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in b["rounds"]:
            pl, pt = r["plugin"], r["pass-through"]
            lines.append(f"| {r['round']}{'' if r['quiet'] else ' (left out)'} |"
                         f" {pl['p50_us']:,.0f} µs | {pl['p99_us']:,.0f} µs |"
                         f" {pt['p50_us']:,.0f} µs | {pt['p99_us']:,.0f} µs |"
                         f" {r['p99_added_us']:,.0f} µs | {r['plugin_call_p99_at_most_us']} µs |"
                         f" {r['cpu_busy_pct'][GATEWAY_CORE]:.0f} %"
                         f" ({r['gateway_core_busy_pct']:.0f} %) |"
                         f" {', '.join(f'{v:.1f} %' for v in r['steal_pct'].values())} |")
        lines.append("")
        if "p99_added_by_plugin_us" in b:
            lines += [f"- p99 added by the plugin (median over {b['quiet_rounds']} quiet rounds "
                      f"of plugin minus pass-through in the same round): "
                      f"**{b['p99_added_by_plugin_us']:,.0f} µs**; p50 added "
                      f"{b['p50_added_by_plugin_us']:,.0f} µs",
                      f"- the plugin call itself, timed in the gateway: 99 % of calls took at "
                      f"most {b['plugin_call_p99_at_most_us']} µs (worst quiet round's "
                      "histogram bucket)", ""]
        else:
            lines += ["- no quiet round: the host's steal time decided every tail; run again", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", default="10s", help="oha -z of each fixed-rate run")
    ap.add_argument("--connections", type=int, default=16, help="oha -c at the fixed rate")
    ap.add_argument("--peak-duration", default="5s", help="oha -z of the closed-loop run")
    ap.add_argument("--peak-connections", type=int, default=32)
    ap.add_argument("--max-steal", type=float, default=0.5,
                    help="leave out of the medians a round in which the hypervisor stole more "
                         "than this %% of a CPU (default 0.5)")
    ap.add_argument("--body", action="append", choices=["1KiB", "64KiB"],
                    help="only this body (repeatable; default both)")
    ap.add_argument("--snowgate", default=os.path.join(ROOT, "target/release/snowgate"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results"))
    args = ap.parse_args()

    problems = []
    if (os.cpu_count() or 1) < 2:
        problems.append("needs at least 2 CPUs: one for the gateway, one for everything else")
    if not shutil.which("taskset"):
        problems.append("taskset is missing: apt-get install -y util-linux")
    args.nginx, args.nginx_modules = load.find_nginx(), load.find_lua_modules()
    if not args.nginx or not args.nginx_modules:
        problems.append("apt-get install -y nginx libnginx-mod-http-lua")
    args.oha = load.find_oha()
    if not args.oha:
        problems.append("oha is missing: cargo install oha --locked --root /opt/oha")
    if not os.access(args.snowgate, os.X_OK):
        problems.append(f"{args.snowgate} is missing: cargo build --release")
    if problems:
        sys.exit("cannot run:\n  " + "\n  ".join(problems))

    signal.signal(signal.SIGTERM, load._on_signal)
    signal.signal(signal.SIGINT, load._on_signal)
    run = Run(args)
    # atexit runs the last registered first: stop the processes, then remove their directory
    atexit.register(lambda: shutil.rmtree(run.tmp, ignore_errors=True))
    atexit.register(load._stop_all)
    load_start = os.getloadavg()
    run.start()
    bodies = {name: run.body(name) for name in run.bodies}
    result = {
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python3 bench/added_latency.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPUs ({load.cpu_model()}), 1-min load average "
                   f"{load_start[0]:.2f} at start",
        "settings": {"rounds": args.rounds, "duration": args.duration,
                     "connections": args.connections, "peak_duration": args.peak_duration,
                     "peak_connections": args.peak_connections,
                     "max_steal": args.max_steal},
        "commands": run.commands,
        "bodies": bodies,
    }
    report = markdown(result)
    load.write_report(args.out, "added-latency", result, report)
    print(report)


if __name__ == "__main__":
    main()
