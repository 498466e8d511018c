#!/usr/bin/env python3
"""Transparent huge pages on and off, side by side: throughput and resident memory.

    python3 bench/huge_pages.py               # 5 rounds x 10 s per body and variant
    python3 bench/huge_pages.py --rounds 3

snowgate turns THP off for itself unless MIMALLOC_ALLOW_THP is set
(host/src/bin/snowgate/huge_pages.rs). This runs two gateways from the same binary side by
side (bench/variants.py says how): `thp-off` (the default) and `thp-on`
(MIMALLOC_ALLOW_THP=1), and writes bench/results/huge-pages.md. Under the kernel policy
`never` (/sys/kernel/mm/transparent_hugepage/enabled) both variants are the same.

Needs nginx, wrk and a release build. Python standard library only.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import variants  # noqa: E402  (two environments of one binary, side by side)


def kernel_policy() -> str:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        return f"Kernel THP policy: `{f.read().strip()}`."


if __name__ == "__main__":
    variants.compare(variants.arguments(__doc__),
                     {"thp-off": {}, "thp-on": {"MIMALLOC_ALLOW_THP": "1"}},
                     "Transparent huge pages off (default) and on (bench/huge_pages.py)",
                     "huge-pages.md", kernel_policy)
