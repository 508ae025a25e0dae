"""The operations that take the most time in a JAX profiler trace (an .xplane.pb), per device stream.

    .venv/bin/python bench/profile_top.py TRACE.xplane.pb [--top 25] [--host]

Device planes only (GPU/TPU) unless --host, which also lists the CPU thunks (XLA:CPU runs ops on host threads).
"""
from __future__ import annotations

import argparse
import collections
import sys


def top_ops(xplane_path: str, top: int = 25, host: bool = False) -> list[str]:
    """Report lines: one header per (plane, line) with events, then its `top` names by total duration."""
    from jax.profiler import ProfileData

    lines = []
    for plane in ProfileData.from_file(xplane_path).planes:
        if not host and "/device:" not in plane.name:
            continue
        for line in plane.lines:
            totals, counts = collections.Counter(), collections.Counter()
            for event in line.events:
                totals[event.name] += event.duration_ns
                counts[event.name] += 1
            if not totals:
                continue
            lines.append(f"== {plane.name} / {line.name}: {sum(counts.values())} events, "
                         f"{sum(totals.values()) / 1e6:.1f} ms")
            lines += [f"  {ns / 1e6:9.2f} ms {counts[name]:6d}x  {name[:100]}" for name, ns in totals.most_common(top)]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host", action="store_true")
    args = parser.parse_args()
    print("\n".join(top_ops(args.trace, args.top, args.host)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
