"""`streamrl report RUN_DIR [-o OUTDIR]`: PNG plots and report.md of a run, from its trace
files and summary.json alone (no Redis, no config), into OUTDIR (default RUN_DIR/report).

    streamrl report runs/demo
    streamrl report runs/demo -o /tmp/demo-report
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("report", help="plots and a Markdown summary of a run, from its files")
    r.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (traces/, summary.json)")
    r.add_argument("-o", "--out", default=None, metavar="OUTDIR", help="default RUN_DIR/report")


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"streamrl report: no run directory {run_dir}", file=sys.stderr)
        return 2
    from streamrl.obs.report import write_report  # matplotlib: only for this command

    path = write_report(run_dir, Path(args.out) if args.out else None)
    print(f"streamrl report: {path}")
    return 0
