"""What a worker's counters cost: the hot-path calls its loop makes, and one sample.

    .venv/bin/python ops/bench/metrics.py [--events 200000] [--window 60]

Times `Metrics.count`, `Metrics.observe` and `Metrics.set` (what an episode, a commit or a
tool call adds to the worker's own time), and `Metrics.sample` with a window full of
observed values (what the sampler thread spends each `metrics.interval_s`, beside the
worker's loop: the tool latency percentiles sort the window). No Redis: the XADD is one
round trip on top.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from streamrl.obs import metrics as m


def per_call_ns(fn: Callable[[int], None], n: int) -> float:
    start = time.perf_counter_ns()
    for i in range(n):
        fn(i)
    return (time.perf_counter_ns() - start) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--events", type=int, default=200_000)
    p.add_argument("--window", type=float, default=60.0)
    args = p.parse_args()
    metrics = m.Metrics("bench-0", rate_window_s=args.window)
    n = args.events
    count = per_call_ns(lambda i: metrics.count(m.TRAJECTORIES), n)
    observe = per_call_ns(lambda i: metrics.observe(m.TOOL_LATENCY_S, i * 1e-6), n)
    level = per_call_ns(lambda i: metrics.set(m.ACTIVE_EPISODES, i), n)
    for i in range(n):  # a window of n rewards and n policy ages beside the latencies
        metrics.observe(m.REWARD, i % 2)
        metrics.observe(m.POLICY_AGE, i % 3)
    metrics.probe(m.memory_probe)
    start = time.perf_counter()
    values = metrics.sample()
    sample_ms = (time.perf_counter() - start) * 1000
    print(f"count   {count:8.0f} ns/call")
    print(f"observe {observe:8.0f} ns/call")
    print(f"set     {level:8.0f} ns/call")
    kept = min(n, m.WINDOW_CAP)
    print(f"sample  {sample_ms:8.1f} ms, {kept} values per window x 3 series, {len(values)} names")


if __name__ == "__main__":
    main()
