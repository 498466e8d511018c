#!/usr/bin/env python3
"""Load benchmark: snowgate against nginx, side by side, in one run.

    python3 bench/load.py                      # 3 rounds x 10 s, wrk -t2 -c64
    python3 bench/load.py --rounds 5 --duration 20s

Starts, on 127.0.0.1 with free ports, in a temporary directory:

  upstream          nginx answering `return 200` at once (the upstream of every proxy below)
  snowgate-plugin   target/release/snowgate serve, JSON requests through the WASI plugin
                    (default settings: an instance serves up to 1000 requests)
  snowgate-fresh    the same with --plugin-calls-per-instance 1: a fresh plugin instance
                    for every request (the strictest isolation, and its cost)
  snowgate-pass     a second snowgate, driven with Content-Type: text/plain so that the
                    gateway streams the body through without calling the plugin
                    (snowgate has no flag that turns the plugin off)
  nginx-proxy       nginx proxy_pass to the upstream (keep-alive pool)
  nginx-lua         nginx + lua-nginx-module: access_by_lua reads the body, cjson-decodes
                    it, stamps disaggregated_params.disagg_request_id into context-only
                    requests, re-encodes it, then proxy_pass

then checks once that each one forwards what it should (through an echo location on the
upstream), and drives each in turns with wrk, round after round, on a 1 KiB chat request and
a 64 KiB request (both context-only, no id). Then, if `oha` is on the PATH, it measures the
latency at a fixed rate of half of snowgate-plugin's peak.

Writes bench/results/latest.json, latest.md and load.svg (or into --out) and stops everything
on exit.
Installs nothing: a missing tool is reported with the command that installs it.
Python standard library only.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as _dt
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "127.0.0.1"
PATH = "/v1/chat/completions"
ECHO_PATH = "/__bench_echo"
MACHINE_ID = 1

LUA_MODULE_DIRS = ["/usr/lib/nginx/modules", "/usr/share/nginx/modules"]
CJSON_DIRS = ["/usr/lib/x86_64-linux-gnu/lua/5.1", "/usr/lib/aarch64-linux-gnu/lua/5.1",
              "/usr/local/lib/lua/5.1", "/usr/lib/lua/5.1"]

TARGETS = ["upstream", "snowgate-plugin", "snowgate-fresh", "snowgate-pass", "nginx-proxy",
           "nginx-lua"]
STAMPING_SNOWGATES = ("snowgate-plugin", "snowgate-fresh")
LABELS = {
    "upstream": "upstream direct (nginx return 200)",
    "snowgate-plugin": "snowgate + plugin",
    "snowgate-fresh": "snowgate + plugin, fresh instance per request",
    "snowgate-pass": "snowgate pass-through (no plugin call)",
    "nginx-proxy": "nginx proxy_pass",
    "nginx-lua": "nginx + Lua rewrite (cjson)",
}
SHORT = {
    "upstream": "upstream direct",
    "snowgate-plugin": "snowgate + plugin",
    "snowgate-fresh": "snowgate + plugin, fresh",
    "snowgate-pass": "snowgate pass-through",
    "nginx-proxy": "nginx proxy_pass",
    "nginx-lua": "nginx + Lua",
}
COLORS = {
    "upstream": "#9e9e9e",
    "snowgate-plugin": "#1565c0",
    "snowgate-fresh": "#7e57c2",
    "snowgate-pass": "#64b5f6",
    "nginx-proxy": "#2e7d32",
    "nginx-lua": "#ef6c00",
}

# ---------------------------------------------------------------------------------------------
# processes

_started: list[subprocess.Popen] = []


def _stop_all() -> None:
    """Stops every process this script started, by its own pid, newest first."""
    for proc in reversed(_started):
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)  # nginx master: fast shutdown; snowgate: drain
            except ProcessLookupError:
                pass
    deadline = time.time() + 10
    for proc in reversed(_started):
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own group (start_new_session)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=5)
    _started.clear()


def _on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def start(cmd: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    _started.append(proc)
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None, ctype: str | None = None,
         timeout: float = 5.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method)
    if ctype:
        req.add_header("Content-Type", ctype)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_ready(url: str, proc: subprocess.Popen, log_path: str, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{' '.join(proc.args)} exited with {proc.returncode}; log:\n"
                     + open(log_path, errors="replace").read()[-3000:])
        try:
            # Ready, not merely alive: a starting snowgate answers /healthz
            # before it serves (its plugin compiling).
            if http("GET", url, timeout=1.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    sys.exit(f"{url} did not answer within {timeout} s; log {log_path}")


def children_of(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def proc_cpu_ticks(pid: int) -> int:
    """utime + stime of a process (all its threads), in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def cpu_stat_ticks() -> dict[str, list[int]]:
    """The first eight tick counters since boot (user, nice, system, idle, iowait, irq,
    softirq, steal) of each `cpu` line of /proc/stat: "cpu" for all CPUs, "cpu0", "cpu1", ...
    Steal is time the hypervisor ran something else while this VM wanted its CPUs: it comes
    in bursts that stall every process here for milliseconds."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu"):
                name, *vals = line.split()
                out[name] = ([int(v) for v in vals] + [0] * 8)[:8]
    return out


def system_busy_ticks() -> tuple[int, int, int, int]:
    """(busy, total, irq + softirq, steal) ticks of all CPUs since boot."""
    vals = cpu_stat_ticks()["cpu"]
    total = sum(vals)
    return total - vals[3] - vals[4], total, vals[5] + vals[6], vals[7]


def plugin_call_histogram(metrics: str) -> list[tuple[float, float]]:
    """snowgate_plugin_call_seconds from a gateway's /metrics text, as (upper bound in
    seconds, cumulative count) pairs."""
    out = []
    for line in metrics.splitlines():
        m = re.match(r'snowgate_plugin_call_seconds_bucket\{le="([^"]+)"\} (\S+)', line)
        if m:
            le = float("inf") if m.group(1) == "+Inf" else float(m.group(1))
            out.append((le, float(m.group(2))))
    return out


# ---------------------------------------------------------------------------------------------
# request bodies

def make_bodies() -> dict[str, bytes]:
    """A 1 KiB chat request and a 64 KiB multi-turn one, both context-only with no id."""
    words = ("the quick brown fox jumps over the lazy dog while prefill workers compute "
             "key value caches for long prompts and decode workers stream tokens back ").split()

    def text(n: int, seed: int) -> str:
        out, i = [], seed
        while sum(len(w) + 1 for w in out) < n:
            out.append(words[i % len(words)])
            i += 7
        return " ".join(out)[:n]

    def build(messages: list[dict], size: int) -> bytes:
        def encode(msgs):
            return json.dumps({
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "messages": msgs,
                "max_tokens": 1,
                "temperature": 0.0,
                "stream": False,
                "disaggregated_params": {"request_type": "context_only"},
            }, separators=(",", ":")).encode()
        base = len(encode(messages))
        assert base <= size, (base, size)
        pad = size - base
        messages[-1]["content"] = messages[-1]["content"] + " " + text(pad - 1, 3) if pad else \
            messages[-1]["content"]
        body = encode(messages)
        assert len(body) == size, (len(body), size)
        return body

    small = build([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Summarise the following notes."},
    ], 1024)
    turns = []
    for i in range(90):
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": text(600, i)})
    large = build([{"role": "system", "content": "You are a helpful assistant."}] + turns, 65536)
    return {"1KiB": small, "64KiB": large}


# ---------------------------------------------------------------------------------------------
# nginx configurations

def nginx_common(prefix: str, user_line: str, modules: str) -> str:
    return f"""{user_line}
{modules}
worker_processes auto;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
daemon off;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    client_body_buffer_size 128k;
    client_max_body_size 1m;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    default_type application/json;
"""


def nginx_upstream_conf(prefix: str, port: int, user_line: str, modules: str) -> str:
    # `return 200` answers at once (nginx discards the request body). The echo location, used
    # only by the correctness check, answers with the body it received.
    return nginx_common(prefix, user_line, modules) + f"""
    server {{
        listen {HOST}:{port} reuseport backlog=4096;
        location = {ECHO_PATH} {{
            content_by_lua_block {{
                ngx.req.read_body()
                ngx.print(ngx.req.get_body_data() or "")
            }}
        }}
        location / {{ return 200 '{{"ok":true}}\\n'; }}
    }}
}}
"""


def nginx_proxy_conf(prefix: str, port: int, up_port: int, user_line: str, modules: str,
                     lua: bool) -> str:
    extra_http = ""
    access = ""
    if lua:
        extra_http = f"""
    lua_package_path "{prefix}/lua/?.lua;;";
    lua_package_cpath "{';'.join(d + '/?.so' for d in CJSON_DIRS)};;";
    init_by_lua_block {{ require "stamp" }}
"""
        access = "access_by_lua_block { require(\"stamp\").run() }"
    return nginx_common(prefix, user_line, modules) + extra_http + f"""
    upstream up {{
        server {HOST}:{up_port};
        keepalive 256;
    }}
    server {{
        listen {HOST}:{port} reuseport backlog=4096;
        location / {{
            {access}
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""


# The Lua side of the comparison: what an nginx/OpenResty operator would write to do the same
# stamp. cjson re-encodes the whole table, so the forwarded bytes are not the client's (key
# order, escapes such as "\/", number text, empty arrays become {}); snowgate keeps them.
STAMP_LUA = r"""
local cjson = require "cjson.safe"
local M = {}

local PLACEHOLDER = "__snowgate_bench_id__"
local MACHINE = %d
local last_ms, seq = 0, 0

-- trtllm-v1 layout: 41-bit ms, 10-bit machine, 12-bit sequence. LuaJIT 64-bit integer
-- arithmetic: a double cannot hold the id, and cjson would print it as 7.3987566540465e+18.
local function next_id()
    local ms = math.floor(ngx.now() * 1000)
    if ms <= last_ms then
        ms = last_ms
        seq = seq + 1
        if seq > 4095 then ms, seq = ms + 1, 0 end
    else
        seq = 0
    end
    last_ms = ms
    local machine = (MACHINE + (ngx.worker.id() or 0)) %% 1023
    local id = (0ULL + ms) * 4194304 + machine * 4096 + seq
    return (tostring(id):gsub("U?LL$", ""))
end

function M.run()
    ngx.req.read_body()
    local body = ngx.req.get_body_data()
    if not body then
        local path = ngx.req.get_body_file()
        if not path then return end
        local f = io.open(path, "rb")
        body = f:read("*a")
        f:close()
    end
    local t, err = cjson.decode(body)
    if t == nil then
        ngx.status = 400
        ngx.header["Content-Type"] = "application/json"
        ngx.say('{"error":{"message":"invalid JSON","type":"invalid_request_error"}}')
        return ngx.exit(400)
    end
    if type(t) ~= "table" then return end
    local dp = t.disaggregated_params
    if type(dp) ~= "table" or type(dp.request_type) ~= "string"
        or dp.request_type:lower() ~= "context_only" then
        return
    end
    if dp.disagg_request_id ~= nil and dp.disagg_request_id ~= cjson.null then return end
    dp.disagg_request_id = PLACEHOLDER
    local out = cjson.encode(t)
    local quoted = '"' .. PLACEHOLDER .. '"'
    local s, e = out:find(quoted, 1, true)
    out = out:sub(1, s - 1) .. next_id() .. out:sub(e + 1)
    ngx.req.set_body_data(out)
end

return M
""" % MACHINE_ID


# ---------------------------------------------------------------------------------------------
# load tools

WRK_SCRIPT = r"""
wrk.method = "POST"
wrk.path = "%s"
wrk.headers["Content-Type"] = "%s"
local f = assert(io.open("%s", "rb"))
wrk.body = f:read("*a")
f:close()
%s
"""

UNITS = {"us": 1.0, "ms": 1000.0, "s": 1e6, "m": 60e6, "h": 3600e6}


def parse_duration_us(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text.strip())
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * UNITS[m.group(2)]


def parse_wrk(out: str) -> dict:
    res: dict = {}
    m = re.search(r"Requests/sec:\s*([\d.]+)", out)
    res["rps"] = float(m.group(1)) if m else None
    for pct in ("50", "75", "90", "99"):
        m = re.search(r"^\s+%s%%\s+(\S+)" % pct, out, re.M)
        res[f"p{pct}_us"] = parse_duration_us(m.group(1)) if m else None
    m = re.search(r"(\d+) requests in ([\d.]+\w+)", out)
    res["requests"] = int(m.group(1)) if m else None
    m = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out)
    res["non_2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    res["socket_errors"] = sum(int(g) for g in m.groups()) if m else 0
    return res


def sh_quote(cmd: list[str]) -> str:
    import shlex
    return " ".join(shlex.quote(c) for c in cmd)


# ---------------------------------------------------------------------------------------------
# the benchmark

class Bench:
    def __init__(self, args):
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="snowgate-load-")
        os.chmod(self.tmp, 0o755)
        self.ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids: dict[str, list[int]] = {}
        self.commands: dict[str, str] = {}
        self.configs: dict[str, str] = {}
        self.load_commands: dict[str, str] = {}
        self.bodies = make_bodies()
        self.body_files = write_bodies(self.tmp, self.bodies)
        self.snowgate = private_copy(args.snowgate, self.tmp)
        self.ticks = os.sysconf("SC_CLK_TCK")

    # -- start-up -------------------------------------------------------------------------

    def content_type(self, target: str) -> str:
        return "text/plain" if target == "snowgate-pass" else "application/json"

    def url(self, target: str, path: str = PATH) -> str:
        return f"http://{HOST}:{self.ports[target]}{path}"

    def start_nginx(self, name: str, conf: str) -> None:
        prefix = os.path.join(self.tmp, name)
        for d in ("tmp", "lua", "logs"):
            os.makedirs(os.path.join(prefix, d), exist_ok=True)
        if name == "nginx-lua":
            with open(os.path.join(prefix, "lua", "stamp.lua"), "w") as f:
                f.write(STAMP_LUA)
        conf_path = os.path.join(prefix, "nginx.conf")
        self.configs[name] = conf
        with open(conf_path, "w") as f:
            f.write(conf)
        cmd = [self.args.nginx, "-p", prefix, "-c", conf_path, "-e", f"{prefix}/error.log"]
        test = subprocess.run(cmd + ["-t"], capture_output=True, text=True, timeout=30)
        if test.returncode != 0:
            sys.exit(f"nginx config for {name} is invalid:\n{test.stderr}\n{conf}")
        log = os.path.join(prefix, "stdout.log")
        proc = start(cmd, log)
        self.procs[name] = proc
        self.commands[name] = sh_quote(cmd) + f"   # config: see bench/load.py ({name})"
        wait_ready(self.url(name, "/healthz-probe"), proc, os.path.join(prefix, "error.log"))

    def start_snowgate(self, name: str, extra: list[str] | None = None) -> None:
        admin = free_port()
        self.ports[name + "-admin"] = admin
        cmd = [self.snowgate, "serve", "--listen", f"{HOST}:{self.ports[name]}",
               "--admin-listen", f"{HOST}:{admin}",
               "--upstream", f"http://{HOST}:{self.ports['upstream']}",
               "--machine-id", str(MACHINE_ID)] + (extra or [])
        log = os.path.join(self.tmp, f"{name}.log")
        proc = start(cmd, log)
        self.procs[name] = proc
        self.commands[name] = sh_quote([os.path.relpath(self.args.snowgate, ROOT)
                                        if c == self.snowgate else c for c in cmd])
        wait_ready(f"http://{HOST}:{admin}/readyz", proc, log)

    def start_all(self) -> None:
        for t in TARGETS:
            self.ports[t] = free_port()
        user_line = "user root root;" if os.geteuid() == 0 else ""
        mod_dir = self.args.nginx_modules
        modules = (f"load_module {mod_dir}/ndk_http_module.so;\n"
                   f"load_module {mod_dir}/ngx_http_lua_module.so;")
        up_prefix = os.path.join(self.tmp, "upstream")
        self.start_nginx("upstream", nginx_upstream_conf(
            up_prefix, self.ports["upstream"], user_line, modules))
        for name, lua in (("nginx-proxy", False), ("nginx-lua", True)):
            prefix = os.path.join(self.tmp, name)
            # plain proxy_pass loads no Lua module, so it pays nothing for it
            self.start_nginx(name, nginx_proxy_conf(
                prefix, self.ports[name], self.ports["upstream"], user_line,
                modules if lua else "", lua))
        self.start_snowgate("snowgate-plugin")
        self.start_snowgate("snowgate-fresh", ["--plugin-calls-per-instance", "1"])
        self.start_snowgate("snowgate-pass")
        for name, proc in self.procs.items():
            self.pids[name] = [proc.pid] + children_of(proc.pid)

    # -- correctness ------------------------------------------------------------------------

    def metric(self, target: str, name: str, labels: str = "") -> float:
        _, body = http("GET", f"http://{HOST}:{self.ports[target + '-admin']}/metrics")
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith(name + labels + " ") or (
                    labels == "" and line.startswith(name + " ")):
                total += float(line.split()[-1])
        return total

    def check(self) -> dict:
        """One request per target through the upstream's echo location."""
        report = {}
        for body_name, body in self.bodies.items():
            for target in TARGETS:
                before = (self.metric(target, "snowgate_requests_total",
                                      '{outcome="rewritten"}')
                          if target in STAMPING_SNOWGATES else None)
                status, got = http("POST", self.url(target, ECHO_PATH), body,
                                   self.content_type(target))
                entry = {"status": status, "sent_bytes": len(body), "forwarded_bytes": len(got)}
                if status != 200:
                    sys.exit(f"check failed: {target} {body_name} answered {status}: {got[:300]!r}")
                if target in STAMPING_SNOWGATES + ("nginx-lua",):
                    dp = json.loads(got)["disaggregated_params"]
                    rid = dp.get("disagg_request_id")
                    if not isinstance(rid, int) or rid < (1 << 42):
                        sys.exit(f"check failed: {target} {body_name} forwarded no integer id: {dp}")
                    entry["disagg_request_id"] = rid
                    stripped = got.replace(b',"disagg_request_id":%d' % rid, b"", 1)
                    entry["bytes_preserved_except_id"] = stripped == body
                    if target in STAMPING_SNOWGATES:
                        after = self.metric(target, "snowgate_requests_total",
                                            '{outcome="rewritten"}')
                        entry["metrics_rewritten_delta"] = after - before
                        if after - before != 1 or not entry["bytes_preserved_except_id"]:
                            sys.exit(f"check failed: {target} {body_name}: {entry}")
                    else:
                        entry["same_json_except_id"] = (
                            _without_id(json.loads(got)) == json.loads(body))
                        if not entry["same_json_except_id"]:
                            sys.exit(f"check failed: nginx-lua {body_name} changed the request")
                else:
                    entry["byte_identical"] = got == body
                    if target != "upstream" and got != body:
                        sys.exit(f"check failed: {target} {body_name} changed the body")
                    if target == "snowgate-pass":
                        calls = self.metric(target, "snowgate_plugin_call_seconds_count")
                        entry["plugin_calls_so_far"] = calls
                        if calls != 0:
                            sys.exit("check failed: snowgate-pass called the plugin")
                report.setdefault(body_name, {})[target] = entry
                print(f"  check {body_name:6} {target:16} -> {status}"
                      + (f" id {entry.get('disagg_request_id')}" if 'disagg_request_id' in entry
                         else " body forwarded unchanged" if entry.get("byte_identical") else ""))
        return report

    # -- load -------------------------------------------------------------------------------

    def wrk_script(self, target: str, body_name: str, delay_ms: float | None = None) -> str:
        extra = f"function delay() return {delay_ms:.3f} end" if delay_ms else ""
        path = os.path.join(self.tmp, f"wrk-{target}-{body_name}-{delay_ms or 0}.lua")
        with open(path, "w") as f:
            f.write(WRK_SCRIPT % (PATH, self.content_type(target), self.body_files[body_name],
                                  extra))
        return path

    def snapshot(self) -> dict:
        snap = {name: sum(proc_cpu_ticks(p) for p in pids) for name, pids in self.pids.items()}
        snap["_system"] = system_busy_ticks()
        snap["_time"] = time.monotonic()
        return snap

    def cpu_split(self, a: dict, b: dict, tool_ticks: float) -> dict:
        """CPU used during a run, as % of one core: each server, the load tool, and the rest of
        the machine (other engineers' work)."""
        wall = b["_time"] - a["_time"]
        out = {}
        ours = 0
        for name in self.pids:
            d = b[name] - a[name]
            ours += d
            out[name] = round(100.0 * d / self.ticks / wall, 1)
        out["load tool"] = round(100.0 * tool_ticks / self.ticks / wall, 1)
        busy = b["_system"][0] - a["_system"][0]
        irq = b["_system"][2] - a["_system"][2]
        # interrupt and softirq time: mostly the loopback TCP traffic of the run itself
        out["irq+softirq"] = round(100.0 * irq / self.ticks / wall, 1)
        steal = b["_system"][3] - a["_system"][3]
        # the host took the CPUs away: a run with much of it has the host's latency tail
        out["steal"] = round(100.0 * steal / self.ticks / wall, 1)
        # other processes (other users' builds, kernel threads) and whatever the accounting
        # above missed
        out["everything else"] = round(max(0.0, 100.0 * (busy - ours - tool_ticks - irq - steal)
                                           / self.ticks / wall), 1)
        out["machine busy"] = round(100.0 * busy / self.ticks / wall, 1)
        return out

    def run_tool(self, cmd: list[str], timeout: float) -> tuple[str, float]:
        """Runs a load tool; returns (stdout, its CPU ticks)."""
        out_path = os.path.join(self.tmp, "tool.out")
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            _started.append(proc)  # stopped on exit if the run is interrupted
            deadline = time.time() + timeout
            while True:
                pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    break
                if time.time() > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    pid, status, ru = os.wait4(proc.pid, 0)
                    proc.returncode = -9
                    break
                time.sleep(0.05)
        _started.remove(proc)
        text = open(out_path, errors="replace").read()
        if proc.returncode != 0:
            sys.exit(f"{sh_quote(cmd)} failed ({proc.returncode}):\n{text}")
        return text, (ru.ru_utime + ru.ru_stime) * self.ticks

    def wrk(self, target: str, body_name: str, duration: str, connections: int,
            threads: int, delay_ms: float | None = None) -> dict:
        script = self.wrk_script(target, body_name, delay_ms)
        cmd = [self.args.wrk, f"-t{threads}", f"-c{connections}", f"-d{duration}", "--latency",
               "--timeout", "5s", "-s", script, self.url(target)]
        self.load_commands[f"wrk {target} {body_name}" + (" paced" if delay_ms else "")] = (
            sh_quote(cmd))
        plugin_before = None
        if target in STAMPING_SNOWGATES:
            plugin_before = (self.metric(target, "snowgate_plugin_call_seconds_sum"),
                             self.metric(target, "snowgate_plugin_call_seconds_count"))
        load1 = os.getloadavg()[0]
        a = self.snapshot()
        text, tool_ticks = self.run_tool(cmd, parse_duration_us(duration) / 1e6 + 60)
        b = self.snapshot()
        res = parse_wrk(text)
        res["cpu_pct_of_one_core"] = self.cpu_split(a, b, tool_ticks)
        res["loadavg_1m_before"] = round(load1, 2)
        if res.get("requests"):
            # CPU time the server under test spent per request: unlike req/s, it barely
            # depends on what else the machine runs
            res["server_cpu_us_per_request"] = round(
                1e6 * (b[target] - a[target]) / self.ticks / res["requests"], 1)
            if target != "upstream":
                res["upstream_cpu_us_per_request"] = round(
                    1e6 * (b["upstream"] - a["upstream"]) / self.ticks / res["requests"], 1)
        if plugin_before:
            s = self.metric(target, "snowgate_plugin_call_seconds_sum") - plugin_before[0]
            n = self.metric(target, "snowgate_plugin_call_seconds_count") - plugin_before[1]
            res["plugin_call_mean_us"] = round(1e6 * s / n, 2) if n else None
        if res["rps"] is None or res["p99_us"] is None:
            sys.exit(f"could not parse wrk output:\n{text}")
        if res["non_2xx"] or res["socket_errors"]:
            print(f"    WARNING: {res['non_2xx']} non-2xx, {res['socket_errors']} socket errors")
        return res

    def peak(self) -> list[dict]:
        a = self.args
        runs = []
        print(f"warm-up: {a.warmup} per target and body")
        for body_name in self.bodies:
            for target in TARGETS:
                self.wrk(target, body_name, a.warmup, a.connections, a.threads)
        for rnd in range(1, a.rounds + 1):
            for body_name in self.bodies:
                # round-robin, starting one further along each round so no target always
                # runs first or last
                order = TARGETS[rnd - 1:] + TARGETS[:rnd - 1]
                for target in order:
                    res = self.wrk(target, body_name, a.duration, a.connections, a.threads)
                    res.update(round=rnd, body=body_name, target=target)
                    runs.append(res)
                    print(f"  round {rnd} {body_name:6} {target:16} {res['rps']:10.0f} req/s"
                          f"  p50 {res['p50_us']:7.0f} us  p99 {res['p99_us']:7.0f} us"
                          f"  cpu/req {res.get('server_cpu_us_per_request', 0):5.0f} us"
                          f"  load {res['loadavg_1m_before']:.2f}"
                          f"  other CPU {res['cpu_pct_of_one_core']['everything else']:.0f}%")
        return runs

    def profile(self, body_name: str, seconds: int, out_dir: str) -> dict:
        """A system-wide `perf record` while wrk drives snowgate-plugin: which process gets the
        CPU, and where snowgate spends it."""
        script = self.wrk_script("snowgate-plugin", body_name)
        data = os.path.join(self.tmp, f"perf-{body_name}.data")
        wrk = subprocess.Popen([self.args.wrk, f"-t{self.args.threads}",
                                f"-c{self.args.connections}", f"-d{seconds + 4}s", "--latency",
                                "-s", script, self.url("snowgate-plugin")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
        _started.append(wrk)
        time.sleep(2)
        threads = len(os.listdir(f"/proc/{self.procs['snowgate-plugin'].pid}/task"))
        subprocess.run([self.args.perf_bin, "record", "-F", "499", "-a", "-g", "-o", data, "--",
                        "sleep", str(seconds)], capture_output=True, timeout=seconds + 60)
        wrk_out = wrk.communicate(timeout=seconds + 60)[0]
        _started.remove(wrk)

        def report(*extra):
            p = subprocess.run([self.args.perf_bin, "report", "-i", data, "--stdio", "-g", "none",
                                "--percentage", "relative"] + list(extra),
                               capture_output=True, text=True, timeout=300)
            return "\n".join(l for l in p.stdout.splitlines() if l.strip() and
                             not l.startswith("#"))
        by_comm = report("--no-children", "--sort", "comm", "--percent-limit", "0.3")
        # the split by object, summed from the per-symbol lines (perf's own --sort dso view
        # mislabels rows here)
        # every thread of the snowgate-plugin process (its workers are "snowgate-worker-N")
        pid = str(self.procs["snowgate-plugin"].pid)
        all_syms = report("--no-children", "--pid", pid, "--sort", "dso,sym")
        split: dict[str, float] = {}
        for m in re.finditer(r"^\s*([\d.]+)%\s+(.+?)\s+\[([k.])\]\s", all_syms, re.M):
            name = re.sub(r" tid \d+", "", m.group(2).strip())
            split[name] = split.get(name, 0.0) + float(m.group(1))
        total = sum(split.values()) or 1.0
        by_dso = "\n".join(f"{100 * v / total:8.2f}%  {name}" for name, v in
                           sorted(split.items(), key=lambda kv: -kv[1]) if 100 * v / total >= 0.1)
        by_sym = report("--no-children", "--pid", pid, "--sort", "dso,sym",
                        "--percent-limit", "0.3")
        top_syms = "\n".join(by_sym.splitlines()[:60])
        text = (f"perf record -F 499 -a -g for {seconds} s while wrk drives snowgate-plugin with "
                f"the {body_name} body\nsnowgate threads during the run: {threads}\n\n"
                f"wrk:\n{wrk_out}\n== CPU samples by process name (whole machine) ==\n"
                f"{by_comm}\n\n== snowgate's samples by object, % of snowgate's (JIT = the "
                f"plugin's compiled wasm) ==\n{by_dso}\n\n== snowgate's samples by symbol, % of "
                f"snowgate's (>= 0.3 %) ==\n"
                f"{top_syms}\n")
        path = os.path.join(out_dir, f"perf-{body_name}.txt")
        with open(path, "w") as f:
            f.write(text)
        return {"file": os.path.relpath(path, ROOT), "snowgate_threads": threads,
                "by_comm": by_comm.splitlines()[:12], "snowgate_by_dso": by_dso.splitlines()}

    def call_histogram(self, target: str) -> list[tuple[float, float]]:
        """snowgate_plugin_call_seconds as (upper bound in seconds, cumulative count) pairs."""
        _, body = http("GET", f"http://{HOST}:{self.ports[target + '-admin']}/metrics")
        return plugin_call_histogram(body.decode())

    @staticmethod
    def histogram_quantiles(before, after) -> dict:
        """The bucket bounds below which 50 % and 99 % of the calls between two readings fell:
        the time the plugin call itself added to a request, measured inside the gateway."""
        delta = [(le, a - b) for (le, a), (_, b) in zip(after, before)]
        total = delta[-1][1] if delta else 0
        out = {"calls": total}
        for name, q in (("p50", 0.5), ("p99", 0.99)):
            bound = next((le for le, c in delta if c >= q * total), None) if total else None
            out[f"plugin_call_{name}_at_most_us"] = (
                None if bound is None else "inf" if bound == float("inf") else round(bound * 1e6))
        return out

    def oha(self, target: str, body_name: str, rate: float, duration: str) -> dict:
        cmd = [self.args.oha, "-z", duration, "-q", f"{rate:.0f}", "-c",
               str(self.args.fixed_rate_connections), "--latency-correction", "--no-tui",
               "--output-format", "json", "-m", "POST", "-T", self.content_type(target),
               "-D", self.body_files[body_name], self.url(target)]
        self.load_commands[f"oha {target} {body_name}"] = sh_quote(cmd)
        load1 = os.getloadavg()[0]
        hist_before = self.call_histogram(target) if target in STAMPING_SNOWGATES else None
        a = self.snapshot()
        text, tool_ticks = self.run_tool(cmd, parse_duration_us(duration) / 1e6 + 60)
        b = self.snapshot()
        hist = (self.histogram_quantiles(hist_before, self.call_histogram(target))
                if hist_before is not None else {})
        data = json.loads(text[text.index("{"):])
        pct = data.get("latencyPercentiles", {})
        summary = data.get("summary", {})
        codes = data.get("statusCodeDistribution", {})
        ok = sum(v for k, v in codes.items() if k.startswith("2"))
        return {
            "rps": summary.get("requestsPerSec"),
            "p50_us": pct["p50"] * 1e6 if pct.get("p50") is not None else None,
            "p99_us": pct["p99"] * 1e6 if pct.get("p99") is not None else None,
            "p99_9_us": pct["p99.9"] * 1e6 if pct.get("p99.9") is not None else None,
            "success_rate": summary.get("successRate"),
            "non_2xx": sum(codes.values()) - ok,
            "errors": sum(data.get("errorDistribution", {}).values()),
            "cpu_pct_of_one_core": self.cpu_split(a, b, tool_ticks),
            "loadavg_1m_before": round(load1, 2),
            "tool": "oha (open loop, --latency-correction)",
            **hist,
        }

    def fixed_rate(self, summary: dict) -> dict:
        a = self.args
        out = {}
        targets = ["upstream", "snowgate-pass", "snowgate-plugin", "snowgate-fresh",
                   "nginx-proxy", "nginx-lua"]
        for body_name in self.bodies:
            rate = 0.5 * summary[body_name]["snowgate-plugin"]["rps"]
            entry = {"rate_rps": round(rate), "runs": [], "skipped": {}}
            usable = []
            for t in targets:
                # a target whose own peak is below this rate would only queue up
                if summary[body_name][t]["rps"] < 1.1 * rate:
                    entry["skipped"][t] = (f"its peak ({summary[body_name][t]['rps']:.0f} req/s)"
                                           f" is below 1.1 x the rate")
                else:
                    usable.append(t)
            for rnd in range(1, a.fixed_rate_rounds + 1):
                order = usable[rnd - 1:] + usable[:rnd - 1] if len(usable) >= rnd else usable
                for t in order:
                    if a.oha:
                        res = self.oha(t, body_name, rate, a.fixed_rate_duration)
                    else:
                        c = a.fixed_rate_connections
                        res = self.wrk(t, body_name, a.fixed_rate_duration, c, 1,
                                       delay_ms=1000.0 * c / rate)
                        res["tool"] = "wrk with delay() pacing (closed loop, approximate rate)"
                    res.update(round=rnd, target=t)
                    entry["runs"].append(res)
                    print(f"  fixed {rate:7.0f}/s round {rnd} {body_name:6} {t:16}"
                          f" got {res['rps']:8.0f} req/s p50 {res['p50_us']:7.0f} us"
                          f" p99 {res['p99_us']:7.0f} us"
                          f" steal {res['cpu_pct_of_one_core']['steal']:.1f} %")
            med = {}
            for t in usable:
                rs = [r for r in entry["runs"] if r["target"] == t]
                med[t] = {k: round(statistics.median(r[k] for r in rs), 1)
                          for k in ("rps", "p50_us", "p99_us")}
                med[t]["steal_max_pct"] = max(r["cpu_pct_of_one_core"]["steal"] for r in rs)
            entry["median"] = med
            # A latency is only comparable at the rate asked for: wrk's delay() pacing (without
            # oha) can overshoot it many times over, and then says nothing about half load.
            for t, m in med.items():
                m["rate_held"] = abs(m["rps"] - rate) <= 0.1 * rate
            held = [t for t in med if med[t]["rate_held"]]
            med = {t: m for t, m in med.items() if t in held}
            if "snowgate-plugin" in med and "snowgate-pass" in med:
                entry["p99_added_by_plugin_us"] = round(
                    med["snowgate-plugin"]["p99_us"] - med["snowgate-pass"]["p99_us"], 1)
                entry["p50_added_by_plugin_us"] = round(
                    med["snowgate-plugin"]["p50_us"] - med["snowgate-pass"]["p50_us"], 1)
            if "snowgate-plugin" in med and "upstream" in med:
                entry["p99_added_by_gateway_with_plugin_us"] = round(
                    med["snowgate-plugin"]["p99_us"] - med["upstream"]["p99_us"], 1)
            # measured inside the gateway: the worst round's bucket bound
            for t in STAMPING_SNOWGATES:
                bounds = [r.get("plugin_call_p99_at_most_us") for r in entry["runs"]
                          if r["target"] == t]
                bounds = [b for b in bounds if b is not None]
                if bounds:
                    entry.setdefault("plugin_call_p99_at_most_us", {})[t] = (
                        "inf" if "inf" in bounds else max(bounds))
            out[body_name] = entry
        return out


def _without_id(obj):
    if isinstance(obj, dict):
        return {k: _without_id(v) for k, v in obj.items() if k != "disagg_request_id"}
    if isinstance(obj, list):
        return [_without_id(v) for v in obj]
    return obj


def summarise(runs: list[dict], bodies) -> tuple[dict, dict]:
    summary: dict = {}
    for b in bodies:
        summary[b] = {}
        for t in TARGETS:
            rs = [r for r in runs if r["body"] == b and r["target"] == t]
            summary[b][t] = {
                "rps": round(statistics.median(r["rps"] for r in rs), 1),
                "p50_us": round(statistics.median(r["p50_us"] for r in rs), 1),
                "p99_us": round(statistics.median(r["p99_us"] for r in rs), 1),
                "rps_rounds": [r["rps"] for r in rs],
                "p99_us_rounds": [r["p99_us"] for r in rs],
                "cpu_pct_of_one_core": {
                    k: round(statistics.median(r["cpu_pct_of_one_core"][k] for r in rs), 1)
                    for k in rs[0]["cpu_pct_of_one_core"]},
            }
            summary[b][t]["server_cpu_us_per_request"] = round(statistics.median(
                r.get("server_cpu_us_per_request") or 0 for r in rs), 1)
            pc = [r["plugin_call_mean_us"] for r in rs if r.get("plugin_call_mean_us")]
            if pc:
                summary[b][t]["plugin_call_mean_us"] = round(statistics.median(pc), 2)
    ratios: dict = {}
    for b in bodies:
        s = summary[b]
        p = s["snowgate-plugin"]
        ratios[b] = {}
        for peer in ("nginx-lua", "nginx-proxy", "snowgate-fresh", "snowgate-pass", "upstream"):
            per_round = []
            for rnd in sorted({r["round"] for r in runs}):
                mine = [r for r in runs if r["body"] == b and r["round"] == rnd]
                a = next(r for r in mine if r["target"] == "snowgate-plugin")
                c = next(r for r in mine if r["target"] == peer)
                per_round.append(round(a["rps"] / c["rps"], 3))
            ratios[b][f"snowgate-plugin/{peer}"] = {
                "rps": round(p["rps"] / s[peer]["rps"], 3),
                "rps_per_round": per_round,
                "p50": round(p["p50_us"] / s[peer]["p50_us"], 3),
                "p99": round(p["p99_us"] / s[peer]["p99_us"], 3),
            }
    return summary, ratios


# ---------------------------------------------------------------------------------------------
# the plot (hand-written SVG: no plotting library needed)

def svg_plot(summary: dict, fixed: dict | None, meta: dict, path: str) -> None:
    """Per body: peak req/s (linear), latency at peak (log), latency at a fixed rate (log)."""
    import math
    bodies = list(summary)
    bar_h, gap = 22, 8
    label_w = 200
    panel_w = 300
    panel_gap = 55
    top = 72
    n_panels = 3 if fixed else 2
    block_h = len(TARGETS) * (bar_h + gap) + 62
    width = label_w + n_panels * panel_w + (n_panels - 1) * panel_gap + 30
    height = top + len(bodies) * block_h + 40
    esc = (lambda t: t.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif" '
           f'font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15" '
           f'font-weight="bold">snowgate vs nginx, POST of a context-only request: '
           f'wrk -t{meta["threads"]} -c{meta["connections"]} -d{meta["duration"]}, '
           f'median of {meta["rounds"]} rounds</text>',
           f'<text x="{width / 2}" y="40" text-anchor="middle" fill="#555">'
           f'{meta["nproc"]} CPUs shared by the load tool, the gateway and the upstream; '
           f'1-min load average {meta["load_start"]:.1f} at start, {meta["load_end"]:.1f} at end; '
           f'dots: the individual rounds</text>']

    def nice_max(v: float) -> float:
        if v <= 0:
            return 1
        e = 10 ** math.floor(math.log10(v))
        for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
            if v <= m * e:
                return m * e
        return 10 * e

    def log_pos(v: float, lo: float, hi: float) -> float:
        v = min(max(v, lo), hi)
        return panel_w * (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    def axis(xa: float, y_top: float, ybase: float, ticks: list[tuple[float, str]]) -> None:
        out.append(f'<line x1="{xa}" y1="{y_top}" x2="{xa}" y2="{ybase}" stroke="#333"/>')
        out.append(f'<line x1="{xa}" y1="{ybase}" x2="{xa + panel_w}" y2="{ybase}" '
                   f'stroke="#333"/>')
        for xx, label in ticks:
            out.append(f'<line x1="{xa + xx:.1f}" y1="{ybase}" x2="{xa + xx:.1f}" '
                       f'y2="{ybase + 4}" stroke="#333"/>')
            out.append(f'<line x1="{xa + xx:.1f}" y1="{y_top}" x2="{xa + xx:.1f}" '
                       f'y2="{ybase}" stroke="#000" stroke-opacity="0.08"/>')
            out.append(f'<text x="{xa + xx:.1f}" y="{ybase + 15}" text-anchor="middle" '
                       f'fill="#333" font-size="10">{label}</text>')

    def us_label(v: float) -> str:
        return f"{v / 1000:g} ms" if v >= 1000 else f"{v:g} µs"

    def latency_bars(x: float, y: float, t: str, p50: float, p99: float, lo: float,
                     hi: float) -> None:
        w99, w50 = log_pos(p99, lo, hi), log_pos(p50, lo, hi)
        out.append(f'<rect x="{x}" y="{y}" width="{w99:.1f}" height="{bar_h}" '
                   f'fill="{COLORS[t]}" fill-opacity="0.35"/>')
        out.append(f'<rect x="{x}" y="{y + 5}" width="{w50:.1f}" height="{bar_h - 10}" '
                   f'fill="{COLORS[t]}"/>')
        out.append(f'<text x="{x + min(w99, panel_w - 120) + 4:.1f}" y="{y + bar_h * 0.7}" '
                   f'paint-order="stroke" stroke="white" stroke-width="3">'
                   f'{p50:,.0f} / {p99:,.0f} µs</text>')

    all_lat = [summary[b][t][k] for b in bodies for t in TARGETS for k in ("p50_us", "p99_us")]
    if fixed:
        all_lat += [v[k] for b in bodies for v in fixed[b].get("median", {}).values()
                    for k in ("p50_us", "p99_us")]
    lo = 10 ** math.floor(math.log10(max(1.0, min(all_lat))))
    hi = 10 ** math.ceil(math.log10(max(all_lat) * 1.5))
    log_ticks = []
    v = lo
    while v <= hi:
        log_ticks.append((log_pos(v, lo, hi), us_label(v)))
        v *= 10

    for bi, b in enumerate(bodies):
        y0 = top + bi * block_h
        out.append(f'<text x="10" y="{y0 + 4}" font-size="14" font-weight="bold">'
                   f'{b} body</text>')
        xs = [label_w + i * (panel_w + panel_gap) for i in range(n_panels)]
        titles = ["peak requests / s (higher is better)",
                  "latency at peak: p50 (dark) / p99 (light), log"]
        if fixed:
            titles.append(f"latency at {fixed[b]['rate_rps']:,} req/s (½ of plugin peak), log")
        for xa, title in zip(xs, titles):
            out.append(f'<text x="{xa + panel_w / 2}" y="{y0 + 4}" text-anchor="middle" '
                       f'font-weight="bold" font-size="11">{esc(title)}</text>')
        rmax = nice_max(max(max(summary[b][t]["rps_rounds"]) for t in TARGETS) * 1.05)
        for ti, t in enumerate(TARGETS):
            y = y0 + 14 + ti * (bar_h + gap)
            s = summary[b][t]
            out.append(f'<text x="{label_w - 8}" y="{y + bar_h * 0.7}" text-anchor="end">'
                       f'{esc(SHORT[t])}</text>')
            w = panel_w * s["rps"] / rmax
            out.append(f'<rect x="{xs[0]}" y="{y}" width="{w:.1f}" height="{bar_h}" '
                       f'fill="{COLORS[t]}"/>')
            for v in s["rps_rounds"]:
                out.append(f'<circle cx="{xs[0] + panel_w * v / rmax:.1f}" '
                           f'cy="{y + bar_h / 2}" r="2.5" fill="black" fill-opacity="0.6"/>')
            w_dots = panel_w * max(s["rps_rounds"]) / rmax
            inside = max(w, w_dots) > panel_w - 70
            out.append(f'<text x="{xs[0] + (w - 6 if inside else max(w, w_dots) + 6):.1f}" '
                       f'y="{y + bar_h * 0.7}" text-anchor="{"end" if inside else "start"}" '
                       f'fill="{"white" if inside else "black"}">{s["rps"]:,.0f}</text>')
            latency_bars(xs[1], y, t, s["p50_us"], s["p99_us"], lo, hi)
            if fixed:
                m = fixed[b].get("median", {}).get(t)
                if m:
                    latency_bars(xs[2], y, t, m["p50_us"], m["p99_us"], lo, hi)
                else:
                    out.append(f'<text x="{xs[2] + 4}" y="{y + bar_h * 0.7}" fill="#777">'
                               f'not run: its peak is below this rate</text>')
        ybase = y0 + 14 + len(TARGETS) * (bar_h + gap)
        axis(xs[0], y0 + 10, ybase, [(panel_w * k / 4, f"{rmax * k / 4:,.0f}")
                                     for k in range(5)])
        for xa in xs[1:]:
            axis(xa, y0 + 10, ybase, log_ticks)
    out.append(f'<text x="10" y="{height - 12}" fill="#777" font-size="10">generated by '
               f'bench/load.py at {meta["generated_at"]}. snowgate pass-through: the same '
               f'gateway, body sent as text/plain so the plugin is not called. Fixed rate: '
               f'{esc(meta.get("fixed_tool") or "")}</text>')
    out.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


def steal_text(median: dict) -> str:
    """The worst round's steal of a fixed-rate target; a dash for a report from before it."""
    return f"{median['steal_max_pct']:.1f}" if "steal_max_pct" in median else "–"


def markdown(result: dict) -> str:
    """The tables of BENCHMARKS.md, from one run's results."""
    s, r, fx = result["summary"], result["ratios"], result["fixed_rate"]
    la = result["loadavg"]
    st = result["settings"]
    lines = [f"Run {result['generated_at']}: `{result['command']}`; {result['machine']['nproc']} "
             f"CPUs ({result['machine']['cpu']}); 1/5/15-min load average "
             f"{' '.join(map(str, la['start']))} at start, {' '.join(map(str, la['end']))} at "
             f"end. wrk -t{st['threads']} -c{st['connections']} -d{st['duration']} --latency, "
             f"{st['rounds']} rounds, median of the rounds.", ""]
    for b in s:
        lines += [f"**{b} body** ({st['body_bytes'][b]} bytes)", "",
                  "| target | req/s | p50 | p99 | req/s in each round | server CPU per request "
                  "| CPU while driven, % of one core: server / upstream / wrk / irq+softirq / "
                  "stolen by the host / everything else |",
                  "|---|---:|---:|---:|---|---:|---|"]
        for t in TARGETS:
            e = s[b][t]
            cpu = e["cpu_pct_of_one_core"]
            own = cpu.get(t, 0.0)
            lines.append(
                f"| {LABELS[t]} | {e['rps']:,.0f} | {e['p50_us'] / 1000:.2f} ms | "
                f"{e['p99_us'] / 1000:.2f} ms | {', '.join(f'{x:,.0f}' for x in e['rps_rounds'])}"
                f" | {e.get('server_cpu_us_per_request', 0):,.0f} µs"
                f" | {own:.0f} / {cpu['upstream'] if t != 'upstream' else 0:.0f} / "
                f"{cpu['load tool']:.0f} / {cpu.get('irq+softirq', 0):.0f} / "
                f"{cpu.get('steal', 0):.0f} / {cpu['everything else']:.0f} |")
        lines.append("")
    lines += ["**Ratios** (snowgate + plugin / peer, from the medians; req/s ratio of each "
              "round in brackets)", "",
              "| body | peer | req/s | p50 | p99 |", "|---|---|---:|---:|---:|"]
    for b in r:
        for k, v in r[b].items():
            peer = k.split("/", 1)[1]
            lines.append(f"| {b} | {LABELS[peer]} | {v['rps']:.2f}x "
                         f"({', '.join(f'{x:.2f}' for x in v['rps_per_round'])}) | "
                         f"{v['p50']:.2f}x | {v['p99']:.2f}x |")
    lines.append("")
    if fx:
        lines += ["**At a fixed rate** (half of snowgate + plugin's peak; "
                  f"{st['fixed_rate']['tool']}, -c {st['fixed_rate']['connections']}, "
                  f"{st['fixed_rate']['duration']} x {st['fixed_rate']['rounds']} rounds, median)",
                  "", "| body | rate | target | achieved req/s | p50 | p99 | "
                  "stolen by the host, worst round (% of one core) |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for b in fx:
            for t, m in fx[b].get("median", {}).items():
                held = "" if m.get("rate_held", True) else " (rate not held: not comparable)"
                lines.append(f"| {b} | {fx[b]['rate_rps']:,} | {LABELS[t]} | {m['rps']:,.0f}"
                             f"{held} | {m['p50_us'] / 1000:.3f} ms | {m['p99_us'] / 1000:.3f} ms |"
                             f" {steal_text(m)} |")
            for t, why in fx[b].get("skipped", {}).items():
                lines.append(f"| {b} | {fx[b]['rate_rps']:,} | {LABELS[t]} | not run: {why} | | | |")
        lines.append("")
        for b in fx:
            if "p99_added_by_plugin_us" in fx[b]:
                lines.append(f"- {b}: p99 added by the plugin (snowgate + plugin minus snowgate "
                             f"pass-through) {fx[b]['p99_added_by_plugin_us']:,.0f} µs; p50 "
                             f"added {fx[b]['p50_added_by_plugin_us']:,.0f} µs; p99 added by "
                             f"the whole gateway with plugin (vs upstream direct) "
                             f"{fx[b].get('p99_added_by_gateway_with_plugin_us', float('nan')):,.0f} µs")
            for t, bound in fx[b].get("plugin_call_p99_at_most_us", {}).items():
                lines.append(f"- {b}: {LABELS[t]}: 99 % of plugin calls took at most {bound} µs "
                             f"(snowgate_plugin_call_seconds buckets, worst round)")
        lines.append("")
    lines += ["**Targets**", "", "| body | target | met |", "|---|---|---|"]
    for b, m in result["targets_met"].items():
        for k, v in m.items():
            met = ("not resolved (below zero: the run's noise is larger)" if v is None
                   else "yes" if v else "**no**")
            lines.append(f"| {b} | {k} | {met} |")
    lines.append("")
    pc = {b: s[b]["snowgate-plugin"].get("plugin_call_mean_us") for b in s}
    lines.append("Mean wall time of one plugin call under peak load (snowgate_plugin_call_seconds, "
                 "the plugin call alone, timed inside the gateway): "
                 + ", ".join(f"{b} {v:,.0f} µs" for b, v in pc.items() if v) + ".")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------

def find_nginx() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx")
                                     else None)


def find_lua_modules() -> str | None:
    """The directory of nginx's Lua module (libnginx-mod-http-lua), if installed."""
    return next((d for d in LUA_MODULE_DIRS if os.path.exists(f"{d}/ngx_http_lua_module.so")),
                None)


def find_oha() -> str | None:
    return shutil.which("oha") or next(
        (p for p in ("/opt/oha/bin/oha", os.path.expanduser("~/.cargo/bin/oha"))
         if os.access(p, os.X_OK)), None)


def write_bodies(directory: str, bodies: dict[str, bytes]) -> dict[str, str]:
    """Writes each body to DIRECTORY/body-NAME.json, for the load tools; returns the paths."""
    paths = {}
    for name, body in bodies.items():
        paths[name] = os.path.join(directory, f"body-{name}.json")
        with open(paths[name], "wb") as f:
            f.write(body)
    return paths


def private_copy(snowgate: str, directory: str) -> str:
    """A copy of the binary under test: other builds may replace target/release/snowgate
    during the run."""
    copy = os.path.join(directory, "snowgate")
    shutil.copy2(snowgate, copy)
    return copy


def write_report(directory: str, stem: str, result: dict, text: str) -> None:
    """Writes DIRECTORY/STEM.json (the whole result) and DIRECTORY/STEM.md (its report)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(directory, f"{stem}.md"), "w", encoding="utf-8") as f:
        f.write(text)


def check_tools(args) -> None:
    missing_apt, problems = [], []
    args.nginx = find_nginx()
    if not args.nginx:
        missing_apt.append("nginx")
    args.wrk = shutil.which("wrk")
    if not args.wrk:
        missing_apt.append("wrk")
    args.nginx_modules = find_lua_modules()
    if not args.nginx_modules:
        missing_apt.append("libnginx-mod-http-lua")
    if not any(os.path.exists(f"{d}/cjson.so") for d in CJSON_DIRS):
        missing_apt.append("lua-cjson")
    if not os.access(args.snowgate, os.X_OK):
        problems.append(f"{args.snowgate} is missing: cargo build --release -p snowgate-host")
    args.perf_bin = shutil.which("perf")
    if args.perf and not args.perf_bin:
        missing_apt.append("linux-perf")
    if missing_apt:
        problems.append("apt-get update && apt-get install -y " + " ".join(missing_apt))
    args.oha = None if args.no_oha else find_oha()
    if problems:
        sys.exit("missing tools; install them, then run this again:\n  " + "\n  ".join(problems))
    if not args.oha and not args.no_fixed_rate:
        print("note: oha not found (cargo install oha --locked --root /opt/oha, as BENCHMARKS.md says); the "
              "fixed-rate latency uses wrk with delay() pacing instead (closed loop).")


def tool_versions(args) -> dict:
    def run(cmd):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            return (p.stdout + p.stderr).strip().splitlines()[0]
        except Exception as e:  # noqa: BLE001
            return f"? ({e})"
    import hashlib
    h = hashlib.sha256()
    with open(args.snowgate, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    mtime = _dt.datetime.fromtimestamp(os.path.getmtime(args.snowgate), _dt.timezone.utc)
    v = {"nginx": run([args.nginx, "-v"]), "wrk": run([args.wrk, "-v"]),
         "snowgate": f"{run([args.snowgate, '--version'])}, {os.path.relpath(args.snowgate, ROOT)}"
                     f" built {mtime.isoformat(timespec='seconds')}, sha256 {h.hexdigest()[:16]}"}
    if args.oha:
        v["oha"] = run([args.oha, "--version"])
    try:
        v["lua-nginx-module"] = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Version}", "libnginx-mod-http-lua"],
            capture_output=True, text=True, timeout=10).stdout
    except Exception:  # noqa: BLE001
        pass
    return v


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", default="10s", help="wrk -d per run (default 10s)")
    ap.add_argument("--warmup", default="3s", help="wrk -d of the warm-up run per target/body")
    ap.add_argument("--connections", type=int, default=64, help="wrk -c (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="wrk -t (default 2)")
    ap.add_argument("--fixed-rate-rounds", type=int, default=3)
    ap.add_argument("--fixed-rate-duration", default="10s")
    ap.add_argument("--fixed-rate-connections", type=int, default=16)
    ap.add_argument("--no-fixed-rate", action="store_true")
    ap.add_argument("--no-oha", action="store_true", help="pace wrk instead of using oha")
    ap.add_argument("--snowgate", default=os.path.join(ROOT, "target/release/snowgate"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results"))
    ap.add_argument("--keep-tmp", action="store_true")
    ap.add_argument("--perf", type=int, default=0, metavar="SECONDS",
                    help="also profile the whole machine with perf while wrk drives "
                         "snowgate-plugin, SECONDS per body (needs linux-perf)")
    args = ap.parse_args()

    check_tools(args)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)

    load_start = os.getloadavg()
    started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}"
          f" on {os.cpu_count()} CPUs")
    if load_start[0] > 0.5 * (os.cpu_count() or 1):
        print("WARNING: the machine is busy (1-min load average above half the CPU count); "
              "the load tool, the servers and whatever else runs share the CPUs, so the numbers "
              "will be noisy. The 'everything else' CPU column shows how much each run lost.")
    bench = Bench(args)
    # atexit runs the last registered first: stop the processes, then remove their directory
    if not args.keep_tmp:
        atexit.register(lambda: shutil.rmtree(bench.tmp, ignore_errors=True))
    atexit.register(_stop_all)
    bench.start_all()
    print("started: " + ", ".join(f"{t} :{bench.ports[t]}" for t in TARGETS))
    checks = bench.check()
    runs = bench.peak()
    summary, ratios = summarise(runs, bench.bodies)
    fixed = None if args.no_fixed_rate else bench.fixed_rate(summary)
    profiles = {}
    if args.perf:
        os.makedirs(args.out, exist_ok=True)
        for b in bench.bodies:
            print(f"profiling snowgate-plugin with the {b} body for {args.perf} s")
            profiles[b] = bench.profile(b, args.perf, args.out)
    load_end = os.getloadavg()
    print(f"load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")

    targets_met = {}
    for b in bench.bodies:
        r = ratios[b]
        targets_met[b] = {
            "rps >= 1.5 x nginx+Lua": r["snowgate-plugin/nginx-lua"]["rps"] >= 1.5,
            "rps >= 0.9 x nginx proxy_pass": r["snowgate-plugin/nginx-proxy"]["rps"] >= 0.9,
        }
        if fixed and "p99_added_by_plugin_us" in fixed[b]:
            # Below zero, pass-through's p99 was the higher: the run's noise
            # is larger than what the plugin adds, and tells nothing of it.
            added = fixed[b]["p99_added_by_plugin_us"]
            targets_met[b]["p99 added by plugin at half peak < 100 us (end to end, "
                           "plugin minus pass-through)"] = (
                None if added < 0 else added < 100)
        bound = (fixed or {}).get(b, {}).get("plugin_call_p99_at_most_us", {}).get(
            "snowgate-plugin")
        if bound is not None:
            targets_met[b]["p99 added by plugin at half peak < 100 us (plugin call, "
                           "in the gateway)"] = bound != "inf" and bound <= 100

    result = {
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "started_at": started_at,
        "command": "python3 bench/load.py " + " ".join(sys.argv[1:]),
        "machine": {"nproc": os.cpu_count(), "cpu": cpu_model(), "kernel": platform.release()},
        "loadavg": {"start": [round(x, 2) for x in load_start],
                    "end": [round(x, 2) for x in load_end]},
        "tools": tool_versions(args),
        "settings": {"rounds": args.rounds, "duration": args.duration, "warmup": args.warmup,
                     "connections": args.connections, "threads": args.threads,
                     "body_bytes": {k: len(v) for k, v in bench.bodies.items()},
                     "path": PATH, "nginx_worker_processes": "auto",
                     "fixed_rate": None if args.no_fixed_rate else {
                         "rounds": args.fixed_rate_rounds,
                         "duration": args.fixed_rate_duration,
                         "connections": args.fixed_rate_connections,
                         "tool": "oha" if args.oha else "wrk-delay"}},
        "labels": LABELS,
        "server_commands": bench.commands,
        "nginx_configs": bench.configs,
        "load_commands": bench.load_commands,
        "wrk_script_example": open(bench.wrk_script("snowgate-plugin", "1KiB")).read(),
        "nginx_lua_stamp": STAMP_LUA,
        "correctness": checks,
        "summary": summary,
        "ratios": ratios,
        "fixed_rate": fixed,
        "targets_met": targets_met,
        "profiles": profiles,
        "runs": runs,
    }
    write_report(args.out, "latest", result, markdown(result))
    svg_plot(summary, fixed, {
        "threads": args.threads, "connections": args.connections, "duration": args.duration,
        "rounds": args.rounds, "nproc": os.cpu_count(), "load_start": load_start[0],
        "load_end": load_end[0], "generated_at": result["generated_at"],
        "fixed_tool": None if not fixed else (
            f"oha -q RATE -c {args.fixed_rate_connections} --latency-correction (open loop)"
            if args.oha else f"wrk -c {args.fixed_rate_connections} paced with delay()")},
        os.path.join(args.out, "load.svg"))

    print()
    for b in bench.bodies:
        print(f"{b}: median of {args.rounds} rounds")
        for t in TARGETS:
            s = summary[b][t]
            print(f"  {LABELS[t]:42} {s['rps']:10.0f} req/s  p50 {s['p50_us']:7.0f} us"
                  f"  p99 {s['p99_us']:7.0f} us")
        for k, v in ratios[b].items():
            print(f"  {k:34} req/s x{v['rps']:.2f}  p99 x{v['p99']:.2f}")
        if fixed:
            fx = fixed[b]
            print(f"  at {fx['rate_rps']} req/s: p99 added by the plugin "
                  f"{fx.get('p99_added_by_plugin_us')} us (vs pass-through)")
        for k, v in targets_met[b].items():
            print(f"  target {k}: {'not resolved' if v is None else 'met' if v else 'NOT met'}")
    print(f"\nwrote {', '.join(os.path.relpath(os.path.join(args.out, n), ROOT) for n in ('latest.json', 'latest.md', 'load.svg'))}")


if __name__ == "__main__":
    main()
