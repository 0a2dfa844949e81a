"""A synthetic run directory for the report's tests: six workers' trace files written with
TraceWriter, with the issue-16 contract's span and counter names and a bottleneck built in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from streamrl.obs.tracing import TraceWriter

T0 = 1_700_000_000 * 10**9  # the run's first event (ns)
S = 10**9

RUN_S = 120
TICK_S = 2


def _counters(w: TraceWriter, series: dict[str, Callable[[int], float]]) -> None:
    """Each counter of `series` (name -> value at t s) every TICK_S s from 0 to RUN_S."""
    for t in range(0, RUN_S + 1, TICK_S):
        for name, f in series.items():
            w.counter(name, f(t), T0 + t * S)


def _constant(value: float) -> Callable[[int], float]:
    return lambda t: value


def write_synthetic_run(run_dir: Path, *, counters: bool = True, tools: bool = True) -> None:
    """Six workers over 120 s. The trainer is the bottleneck by its queue: groups wait 2 deep
    until 60 s, then pile up by 1 every 4 s (15/min). rollout-0 is busier (90 % decoding)
    than trainer-0 (55 %: a 10 s cycle of batch_wait 4 s, train.step 5 s, publish 0.5 s),
    so the busy-fraction rule alone would name the wrong stage."""
    traces = run_dir / "traces"
    feeder = TraceWriter(traces / "feeder-0.pftrace", "feeder-0", pid=10)
    grouper = TraceWriter(traces / "grouper-0.pftrace", "grouper-0", pid=11)
    trainer = TraceWriter(traces / "trainer-0.pftrace", "trainer-0", pid=12)
    tools_w = TraceWriter(traces / "tools-0.pftrace", "tools-0", pid=13)
    rollouts = [
        TraceWriter(traces / f"rollout-{i}.pftrace", f"rollout-{i}", pid=20 + i) for i in range(2)
    ]
    step = trainer.track("step", "train")
    for cycle in range(RUN_S // 10):
        c = T0 + cycle * 10 * S
        trainer.span(step, "trainer.batch_wait", c, c + 4 * S)
        trainer.span(step, "train.step", c + 4 * S, c + 9 * S)
        trainer.span(step, "weights.publish", c + 9 * S, c + 9 * S + S // 2)
        for i, r in enumerate(rollouts):
            ep = r.track("episode", f"g{cycle}-m{i}")
            decode_s = 9 if i == 0 else 6
            r.span(ep, "model.decode", c, c + decode_s * S)
            r.span(ep, "env.step", c + decode_s * S, c + decode_s * S + S // 2)
            if tools:
                r.span(ep, "tool.wait", c + decode_s * S, c + decode_s * S + S // 2)
            r.span(ep, "episode", c, c + decode_s * S + S // 2)
            r.span(r.track("slot", "lock"), "weights.lock_wait", c + 9 * S + S // 2, c + 10 * S)
            if tools:
                call = tools_w.track("call", f"c{cycle}-{i}")
                tools_w.span(call, "tool.queue", c + decode_s * S, c + decode_s * S + S // 10)
                exec_ms = 100 + 50 * i + 10 * cycle
                tools_w.span(
                    call,
                    "tool.exec",
                    c + decode_s * S + S // 10,
                    c + decode_s * S + (100 + exec_ms) * 10**6,
                )
        grouper.span(grouper.track("group", f"g{cycle}"), "group.wait", c, c + 7 * S)
    if counters:
        _counters(feeder, {"queue.tasks.depth": lambda t: 16 - (t // TICK_S) % 2})
        _counters(
            grouper,
            {
                "groups_per_min": lambda t: 6.0,
                "queue.trajectories.depth": lambda t: 3 + (t // TICK_S) % 3,
            },
        )
        _counters(
            trainer,
            {
                "queue.groups.depth": lambda t: 2.0 if t < 60 else 2 + (t - 60) / 4,
                "queue.groups.lag": lambda t: 1.0,
                "examples_per_min": lambda t: 48.0,
                "examples_total": lambda t: 8 * (t // 10),
                "reward_mean": lambda t: 0.2 + t / 200,
                "solve_rate": lambda t: t / 240,
                "rss_mb": lambda t: 900 + t,
                "device_mem_peak_mb": lambda t: 4000.0,
            },
        )
        for i, r in enumerate(rollouts):
            _counters(
                r,
                {
                    "trajectories_per_min": _constant(24.0 + i),
                    "policy_age": lambda t: 0.5,
                    "policy_age_max": lambda t: 1.0 + (t // 30),
                    "rss_peak_mb": lambda t: 1200.0 + t,
                },
            )
        if tools:
            _counters(tools_w, {"queue.tools.depth": lambda t: (t // TICK_S) % 2})
    for w in (feeder, grouper, trainer, tools_w, *rollouts):
        w.close()
