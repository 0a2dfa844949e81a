"""`streamrl trace RUN_DIR [-o OUT]`: merge the run's worker traces into one Perfetto trace.

    streamrl trace runs/demo                  # -> runs/demo/trace.pftrace
    streamrl trace runs/demo -o /tmp/t.pftrace

Each worker wrote RUN_DIR/traces/<worker>.pftrace (`streamrl.obs.tracing`); the merge is one
process per worker, on one clock (the Redis server's), which ui.perfetto.dev opens as it
is (Open trace file). Prints what it merged: the processes, spans per name, counters.
Needs no config and no Redis: it works on a finished run, or on a live one (each file is
read up to its last whole packet).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from streamrl.obs.tracing import TRACES_DIR, TraceSummary, merge_run, trace_files

DEFAULT_OUT = "trace.pftrace"  # under RUN_DIR


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser("trace", help="merge a run's worker traces into one Perfetto trace")
    t.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    t.add_argument("-o", "--out", default=None, help=f"output file (default RUN_DIR/{DEFAULT_OUT})")


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not trace_files(run_dir):
        print(f"streamrl: no trace files in {run_dir / TRACES_DIR}", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else run_dir / DEFAULT_OUT
    summary = merge_run(run_dir, out)
    print(describe(summary, out))
    return 0


def describe(s: TraceSummary, out: Path) -> str:
    """What the merge holds, one thing a line."""
    lines = [f"wrote {out} ({out.stat().st_size:,} bytes): open it at https://ui.perfetto.dev"]
    lines.append(f"processes ({len(s.processes)}):")
    lines += [f"  {name} (pid {pid})" for pid, name in sorted(s.processes, key=lambda p: p[1])]
    lines.append(f"spans ({sum(s.spans.values()):,}):")
    lines += [f"  {name:<22} {n:>9,}" for name, n in sorted(s.spans.items())]
    if s.counters:
        lines.append(f"counter samples ({sum(s.counters.values()):,}):")
        lines += [f"  {name:<22} {n:>9,}" for name, n in sorted(s.counters.items())]
    lines.append(f"flows: {s.flows:,} started or continued, {s.flows_ended:,} ended")
    return "\n".join(lines)
