#!/usr/bin/env python3
"""The least plugin memory `snowgate rewrite` stamps a body in, by kind of body.

    python3 bench/plugin_memory.py target/release/snowgate [--plugin FILE] [--mib 32]

For a body of --mib MiB of each kind, it bisects --plugin-memory-mib
between the body's size and 8 times it, and prints the least limit that
stamps the body, as a multiple of the body's size. The kinds: one id in a
long string; JSON that is nothing but context-only params maps; the same
in MessagePack; and maps of distinct short keys, each over such params
(the most ids a body holds under keys, each held by the walk until its map
ends, in case a later duplicate overrides it): MessagePack uint 32 keys,
at --mib and at the largest size below it where the walk's list of edits
has just doubled (2^k + 1 keys), and JSON keys of a few digits. These are
the figures behind `snowgate_plugin_bundle::memory_needed`. The
MessagePack bodies are written by hand, so no Python package is needed.
"""
import argparse
import struct
import subprocess

PARAMS = b'{"disaggregated_params":{"request_type":"context_only"}}'
PARAMS_MSGPACK = (
    b"\x81\xb4disaggregated_params" + b"\x81\xacrequest_type" + b"\xaccontext_only"
)


def int_keyed(count):
    """A MessagePack map of `count` uint 32 keys, each over params."""
    pairs = b"".join(b"\xce" + struct.pack(">I", key) + PARAMS_MSGPACK for key in range(count))
    return b"\xdf" + struct.pack(">I", count) + pairs


def bodies(size):
    """(name, body, extra rewrite flags) for each kind of body."""
    one = b'{"p":"' + b"x" * (size - 100) + b'",' + PARAMS[1:]
    count = size // (len(PARAMS) + 1)
    dense = b"[" + b",".join([PARAMS] * count) + b"]"
    count = size // len(PARAMS_MSGPACK)
    dense_msgpack = b"\xdd" + struct.pack(">I", count) + PARAMS_MSGPACK * count
    pair = 5 + len(PARAMS_MSGPACK)
    keyed = int_keyed((size - 5) // pair)
    doubled = 1
    while 2 * doubled + 1 <= (size - 5) // pair:
        doubled *= 2
    keyed_doubled = int_keyed(doubled + 1)
    members, length, key = [], 1, 0
    while length + len(str(key)) + 4 + len(PARAMS) <= size:
        members.append(b'"%d":' % key + PARAMS)
        length += len(members[-1]) + 1
        key += 1
    json_keyed = b"{" + b",".join(members) + b"}"
    return [
        ("one id", one, []),
        ("dense JSON", dense, []),
        ("dense MessagePack", dense_msgpack, ["--msgpack"]),
        ("keyed MessagePack", keyed, ["--msgpack"]),
        (f"keyed MessagePack, {doubled + 1} keys", keyed_doubled, ["--msgpack"]),
        ("keyed JSON", json_keyed, []),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary")
    parser.add_argument("--plugin")
    parser.add_argument("--mib", type=int, default=32)
    args = parser.parse_args()
    plugin = ["--plugin", args.plugin] if args.plugin else []
    for name, body, extra in bodies(args.mib << 20):

        def stamps(mib):
            # Time enough that only memory decides, on a busy machine too.
            command = [args.binary, "rewrite", "--machine-id", "1", "--clock", "fixed:1764000000000",
                       "--plugin-memory-mib", str(mib), "--plugin-deadline-ms", "60000",
                       *plugin, *extra]
            return subprocess.run(command, input=body, capture_output=True).returncode == 0

        low, high = len(body) >> 20, 8 * args.mib
        if not stamps(high):
            print(f"{name}: not stamped in {high} MiB")
            continue
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if stamps(middle) else (middle, high)
        print(f"{name}: {len(body) / 2**20:.1f} MiB body stamped in {high} MiB "
              f"({high * 2**20 / len(body):.2f} times)")


if __name__ == "__main__":
    main()
