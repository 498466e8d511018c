#!/usr/bin/env python3
"""mimalloc's delayed purge against purging at once, side by side: throughput, CPU and memory.

    python3 bench/purge_delay.py              # 5 rounds x 10 s per body and variant
    python3 bench/purge_delay.py --rounds 3

mimalloc gives freed pages back to the kernel (`madvise`) only some milliseconds after they
empty (MIMALLOC_PURGE_DELAY, 10 ms by default), and only when the thread that freed them calls
the allocator again, so pages a thread freed just before it went idle stay resident.
MIMALLOC_PURGE_DELAY=0 purges as pages empty, at the cost of more `madvise` calls on the
serving threads. This runs two gateways from the same binary side by side (bench/variants.py
says how): `delayed` (the default) and `at-once` (MIMALLOC_PURGE_DELAY=0), and writes
bench/results/purge-delay.md. What each leaves resident after reloads is
bench/reloads_under_load.py's measure (BENCHMARKS.md, "Reloads and memory").

Needs nginx, wrk and a release build. Python standard library only.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import variants  # noqa: E402  (two environments of one binary, side by side)

if __name__ == "__main__":
    variants.compare(variants.arguments(__doc__),
                     {"delayed": {}, "at-once": {"MIMALLOC_PURGE_DELAY": "0"}},
                     "mimalloc's purge delayed (default) and at once (bench/purge_delay.py)",
                     "purge-delay.md")
