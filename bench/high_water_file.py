#!/usr/bin/env python3
"""What `--high-water-file` costs a gateway under load, side by side with one without it.

    cargo build --release
    python3 bench/high_water_file.py              # 5 rounds x 10 s per body
    python3 bench/high_water_file.py --rounds 3

Runs two gateways from the same binary side by side (bench/variants.py says how): `no file`
(a fixed machine id, as before) and `file` (the same with `--high-water-file` in the run's
scratch directory, whose keeper writes and syncs the mark's two copies about once a second,
and whose requests are checked against the mark), and writes bench/results/high-water-file.md.

Needs nginx, wrk and a release build. Python standard library only.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import variants  # noqa: E402  (two environments of one binary, side by side)

if __name__ == "__main__":
    variants.compare(
        variants.arguments(__doc__),
        {"no file": {}, "file": {}},
        "A fixed machine id without and with --high-water-file (bench/high_water_file.py)",
        "high-water-file.md",
        flags=lambda name, tmp: (["--high-water-file", os.path.join(tmp, "ids.mark")]
                                 if name == "file" else []))
