"""Where a test run's wall time went: reads DIR/timeline-*.jsonl (written by
tests/conftest.py, one line per test) and prints each test process's busy and idle time, how
long 0, 1 or 2+ tests ran at once, the tests that ran alone at the end (the tail no other
process shared), the tests that waited most (wall time past their CPU) and those that
compiled most.

    python ops/test_timeline.py [DIR] [--tail N]   (DIR: build/logs/timeline by default)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Row:
    test: str
    worker: str
    start: float
    end: float
    compile_s: float = 0.0  # XLA compiles in the test's own process
    cpu_s: float | None = None  # CPU of the test's process and the children it waited for


def load(log_dir: Path) -> list[Row]:
    rows: list[Row] = []
    for path in sorted(log_dir.glob("timeline-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                rows.append(
                    Row(
                        str(d["test"]),
                        str(d["worker"]),
                        float(d["start"]),
                        float(d["end"]),
                        float(d.get("compile_s", 0.0)),
                        float(d["cpu_s"]) if "cpu_s" in d else None,
                    )
                )
    return rows


def concurrency(rows: list[Row]) -> dict[int, float]:
    """Seconds during which exactly k tests were running, for each k."""
    events: list[tuple[float, int]] = []
    for r in rows:
        events.append((r.start, 1))
        events.append((r.end, -1))
    events.sort()
    out: dict[int, float] = {}
    running = 0
    last = events[0][0] if events else 0.0
    for t, d in events:
        out[running] = out.get(running, 0.0) + (t - last)
        running += d
        last = t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log_dir", nargs="?", default="build/logs/timeline")
    ap.add_argument("--tail", type=int, default=8, help="tests listed at the end (default 8)")
    args = ap.parse_args()
    rows = load(Path(args.log_dir))
    if not rows:
        print(f"test timeline: no timeline-*.jsonl in {args.log_dir}")
        return
    t0 = min(r.start for r in rows)
    t1 = max(r.end for r in rows)
    print(f"test timeline: {len(rows)} tests, {t1 - t0:.0f} s from first start to last end")
    workers = sorted({r.worker for r in rows})
    print(f"{'process':<8} {'tests':>6} {'busy s':>8} {'idle s':>8} {'last end s':>11}")
    for w in workers:
        mine = [r for r in rows if r.worker == w]
        busy = sum(r.end - r.start for r in mine)
        end = max(r.end for r in mine) - t0
        print(f"{w:<8} {len(mine):>6} {busy:>8.0f} {t1 - t0 - busy:>8.0f} {end:>11.0f}")
    conc = concurrency(rows)
    print("tests at once: " + ", ".join(f"{k}: {v:.0f} s" for k, v in sorted(conc.items())))
    ends = sorted(max(r.end for r in rows if r.worker == w) for w in workers)
    alone_from = ends[-2] if len(ends) > 1 else t0
    print(f"the last {t1 - alone_from:.0f} s ran in one process alone; the last tests:")
    last = sorted(rows, key=lambda r: r.end)[-args.tail :]
    for r in last:
        s, e = r.start - t0, r.end - t0
        print(f"  {r.worker:<6} {s:>7.0f} -> {e:>6.0f} s ({e - s:>5.0f} s)  {r.test}")

    timed = [r for r in rows if r.cpu_s is not None]
    if timed:
        # What waits rather than computes: on a CI machine whose cores the tests keep busy,
        # a test's wall time past its CPU is a core left to the other processes, or idle.
        def waited(r: Row) -> float:
            return r.end - r.start - (r.cpu_s or 0.0)

        wall = sum(r.end - r.start for r in timed)
        cpu = sum(r.cpu_s or 0.0 for r in timed)
        print(
            "CPU of the tests (their processes and the children they waited for): "
            f"{cpu:.0f} s over {wall:.0f} s of test time; the most waiting (wall - CPU):"
        )
        for r in sorted(timed, key=waited)[-args.tail :][::-1]:
            print(f"  {waited(r):>6.1f} s waiting of {r.end - r.start:>6.1f} s  {r.test}")

    compiled = sum(r.compile_s for r in rows)
    print(f"XLA compiles in the test processes themselves: {compiled:.0f} s; the most:")
    for r in sorted(rows, key=lambda r: r.compile_s)[-args.tail :][::-1]:
        print(f"  {r.compile_s:>6.1f} s of {r.end - r.start:>6.1f} s  {r.test}")


if __name__ == "__main__":
    main()
