"""A real MessagePack client and upstream for the gateway: Python's msgspec,
which TensorRT-LLM's orchestrator and workers use for `X-TRTLLM-Msgpack: 1`.

Usage: msgspec_client.py SNOWGATE_BINARY. Starts an upstream that decodes
every body with msgspec, runs `snowgate serve` in front of it, sends
msgspec-encoded requests, and checks what the upstream decoded. Exits 0
when everything holds; otherwise prints what did not and exits 1.
"""
import http.server
import re
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request

import msgspec

decoder = msgspec.msgpack.Decoder()
encoder = msgspec.msgpack.Encoder()
seen = []


class Upstream(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        seen.append(decoder.decode(body))
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def ready_port(gateway):
    """The client port from the gateway's ready line, or None if it stopped
    before it was ready ("snowgate listening on http://127.0.0.1:PORT ...")."""
    line = gateway.stdout.readline().decode()
    match = re.match(r"snowgate listening on http://127\.0\.0\.1:(\d+) ", line)
    return int(match.group(1)) if match else None


def post(port, body):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"content-type": "application/json", "x-trtllm-msgpack": "1"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def main(binary):
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    log = tempfile.TemporaryFile()
    # Ports the kernel picks, read back from the ready line: a port picked
    # here and freed could be taken by another test before snowgate binds.
    gateway = subprocess.Popen(
        [binary, "serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
         "--machine-id", "5",
         "--upstream", f"http://127.0.0.1:{upstream.server_address[1]}"],
        stdout=subprocess.PIPE, stderr=log)
    try:
        port = ready_port(gateway)
        if port is None:
            gateway.wait(timeout=30)
            log.seek(0)
            print("snowgate did not start:", log.read().decode())
            return 1
        context_only = {
            "model": "m", "prompt": "Hello", "max_tokens": 16, "stream": False,
            "disaggregated_params": {"request_type": "context_only",
                                     "disagg_request_id": None, "schedule_style": 0}}
        generation_only = {
            "model": "m", "prompt": "Hello",
            "disaggregated_params": {"request_type": "generation_only",
                                     "disagg_request_id": 1099511628800,
                                     "encoded_opaque_state": "AAEC"}}
        # 15 params members: a fixmap that must become a map 16.
        long_prompt = {
            "model": "m", "prompt_token_ids": list(range(100_000)),
            "disaggregated_params": {"request_type": "CONTEXT_ONLY",
                                     **{f"k{i}": i for i in range(14)}}}
        statuses = [post(port, encoder.encode(r))[0]
                    for r in (context_only, generation_only, long_prompt)]
        refused = post(port, b"\x81")
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)

    problems = []
    if statuses != [200, 200, 200]:
        problems.append(f"statuses {statuses}, expected three 200s")
    if refused[0] != 400 or "invalid_msgpack" not in refused[1]:
        problems.append(f"a cut-short body got {refused}, expected 400 invalid_msgpack")
    if len(seen) != 3:
        problems.append(f"the upstream decoded {len(seen)} bodies, expected 3")
    else:
        ids = [seen[i]["disaggregated_params"].get("disagg_request_id") for i in (0, 2)]
        for sent, got, id in ((context_only, seen[0], ids[0]), (long_prompt, seen[2], ids[1])):
            expected = {**sent, "disaggregated_params": {**sent["disaggregated_params"],
                                                         "disagg_request_id": id}}
            if not isinstance(id, int) or id < 2**42 or got != expected:
                problems.append(f"stamped body decoded as {str(got)[:300]}")
        if ids[0] == ids[1]:
            problems.append(f"one id twice: {ids}")
        if seen[1] != generation_only:
            problems.append(f"generation_only changed: {seen[1]}")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
