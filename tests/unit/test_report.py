"""streamrl.obs.report: interval unions and the precedence of the time breakdown, slopes and the
bottleneck, worked by hand; then a synthetic run written with TraceWriter (six workers,
the contract's span and counter names) reported end to end, checking what each plot drew
and that report.md names the bottleneck built into the data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.patches import Rectangle
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent

from streamrl.evaluation import watch as evalrun
from streamrl.obs.report import (
    Bottleneck,
    QueueTrend,
    bottleneck,
    breakdown,
    figures,
    load_run,
    parse_trace,
    percentiles,
    queue_trends,
    slope,
    subtract,
    union,
    write_report,
)
from streamrl.obs.tracing import TraceWriter, merge, read_trace
from streamrl_workers import cli
from tests.synthetic_run import T0, S, write_synthetic_run

# --- intervals ---------------------------------------------------------------------------


def test_union_joins_overlapping_and_touching_and_drops_empty() -> None:
    got = union([(5, 6), (0, 2), (1, 3), (6, 7), (8, 8)])
    assert got == [(0, 3), (5, 7)]  # (0,2)+(1,3) overlap; (5,6)+(6,7) touch; (8,8) is empty


def test_subtract_cuts_holes_and_edges() -> None:
    assert subtract([(0, 10)], [(2, 3), (5, 7), (9, 12)]) == [(0, 2), (3, 5), (7, 9)]
    assert subtract([(0, 1), (4, 6)], [(0.5, 5)]) == [(0, 0.5), (5, 6)]
    assert subtract([(0, 4)], []) == [(0, 4)]
    assert subtract([(1, 2)], [(0, 3)]) == []


def test_breakdown_unions_each_category_and_applies_precedence() -> None:
    """Wall 0..10 s.
    busy:   train.step 1..4 and 3..5 -> 1..5 (4 s, not 3 + 2); checkpoint.save 9.5..12
            clipped to 9.5..10 (0.5 s): 4.5 s
    tools:  tool.wait 4..7, less busy 1..5 -> 5..7: 2 s
    weight: weights.lock_wait 6..8, less tools 5..7 -> 7..8: 1 s
    starting: worker.start 0..0.5 (first in precedence): 0.5 s
    input:  rollout.input_wait 0..2 and 7.5..9, less 0..0.5 and 1..8 -> 0.5..1 and 8..9: 1.5 s
    other:  10 - 0.5 - 4.5 - 2 - 1 - 1.5 = 0.5 s (9..9.5); the episode span 0..10 counts for
            nothing."""
    spans = [
        ("worker.start", 0.0, 0.5),
        ("episode", 0.0, 10.0),
        ("train.step", 1.0, 4.0),
        ("train.step", 3.0, 5.0),
        ("checkpoint.save", 9.5, 12.0),
        ("tool.wait", 4.0, 7.0),
        ("weights.lock_wait", 6.0, 8.0),
        ("rollout.input_wait", 0.0, 2.0),
        ("rollout.input_wait", 7.5, 9.0),
    ]
    got = breakdown(spans, (0.0, 10.0))
    assert got == pytest.approx(
        {
            "starting": 0.5,
            "busy": 4.5,
            "tools": 2.0,
            "weight_wait": 1.0,
            "input_wait": 1.5,
            "other": 0.5,
        }
    )
    assert sum(got.values()) == pytest.approx(10.0)


def test_breakdown_of_a_worker_without_spans_is_all_other() -> None:
    assert breakdown([], (2.0, 5.0)) == {
        "starting": 0.0,
        "busy": 0.0,
        "input_wait": 0.0,
        "weight_wait": 0.0,
        "tools": 0.0,
        "other": 3.0,
    }


# --- series and the bottleneck -----------------------------------------------------------


def test_slope_is_the_least_squares_fit() -> None:
    assert slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    # t mean 1.5, v mean 1: sum(dt*dv) = 1.5 - 0.5 - 0.5 + 1.5 = 2, sum(dt^2) = 5 -> 0.4
    assert slope([(0, 0), (1, 2), (2, 0), (3, 2)]) == pytest.approx(0.4)
    assert slope([(3, 7)]) == 0.0
    assert slope([(3, 7), (3, 9)]) == 0.0  # no spread in time


def test_queue_trends_fit_the_second_half_only() -> None:
    """Run 0..120 s. trajectories: 50 entries until 60 s (falling from 100 before, which the
    fit must ignore), then +1 every 2 s: 0.5/s = 30/min, rise 0.5 * 60 = 30 entries."""
    traj = [(float(t), 100.0 - t) for t in range(0, 50, 2)]
    traj += [(float(t), 50.0 + (t - 60) / 2) for t in range(60, 121, 2)]
    tasks = [(float(t), 16.0) for t in range(0, 121, 2)]
    trends = queue_trends({"tasks": tasks, "trajectories": traj}, (0.0, 120.0))
    assert [q.stream for q in trends] == ["trajectories", "tasks"]
    assert trends[0].slope_per_min == pytest.approx(30.0)
    assert trends[0].rise == pytest.approx(30.0)
    assert trends[0].grows
    assert trends[1].slope_per_min == pytest.approx(0.0)
    assert not trends[1].grows


def test_bottleneck_is_the_consumer_of_the_fastest_growing_queue() -> None:
    trends = [
        QueueTrend("groups", 12.0, 6.0, 20.0, 30),
        QueueTrend("trajectories", 4.0, 2.5, 10.0, 30),
    ]
    busy = {"rollout-0": {"busy": 9.0, "other": 1.0}, "trainer-0": {"busy": 5.0, "other": 5.0}}
    neck = bottleneck(trends, busy)
    assert neck is not None
    assert (neck.stage, neck.worker) == ("trainer", None)
    assert "`groups` grew +12.0 entries/min" in neck.why


def test_bottleneck_falls_back_to_the_worker_idle_the_least() -> None:
    """No queue rises 2 entries (1.5 is a wobble), nor 10 % of a deep queue's mean (5 of
    100): the busiest worker, trainer-0 at 8 of 10 s, is named."""
    trends = [QueueTrend("tasks", 3.0, 1.5, 4.0, 30), QueueTrend("groups", 10.0, 5.0, 100.0, 30)]
    breakdowns = {
        "rollout-0": {"busy": 5.0, "input_wait": 5.0},
        "trainer-0": {"busy": 8.0, "input_wait": 2.0},
        "grouper-0": {"busy": 0.0, "other": 10.0},
    }
    assert bottleneck(trends, breakdowns) == Bottleneck(
        "trainer",
        "trainer-0",
        "trainer-0 is idle the least: busy 80% of its wall time after its start "
        "(no queue grew over the run's second half)",
    )


def test_bottleneck_in_a_colocated_run_and_with_nothing_to_go_on() -> None:
    trends = [QueueTrend("groups", 12.0, 6.0, 20.0, 30)]
    neck = bottleneck(trends, {"colocated-0": {"busy": 1.0}, "grouper-0": {"busy": 0.0}})
    assert neck is not None and neck.stage == "colocated"
    assert bottleneck([], {"grouper-0": {"busy": 0.0, "other": 3.0}}) is None


def test_percentiles_interpolate_linearly() -> None:
    # 1..10: p50 between 5 and 6 = 5.5; p90 at rank 8.1 = 9.1; p99 at rank 8.91 = 9.91
    assert percentiles([float(x) for x in range(10, 0, -1)]) == pytest.approx([5.5, 9.1, 9.91])


# --- parsing -----------------------------------------------------------------------------


def test_parse_trace_joins_a_restarted_worker_and_drops_a_cut_off_span(tmp_path: Path) -> None:
    """rollout-0 runs twice (pids 1 and 2): one worker, wall 0..7 s; the first process dies
    inside a decode span (written as a lone BEGIN by hand-trimming the file)."""
    a = TraceWriter(tmp_path / "traces" / "rollout-0.pftrace", "rollout-0", pid=1)
    track = a.track("episode", "t1")
    a.span(track, "model.decode", T0, T0 + 2 * S)
    a.counter("policy_age", 1.5, T0 + 3 * S)
    a.close()
    b = TraceWriter(tmp_path / "traces" / "rollout-0b.pftrace", "rollout-0", pid=2)
    b.span(b.track("episode", "t2"), "env.step", T0 + 5 * S, T0 + 7 * S)
    b.close()
    data = parse_trace(read_trace(merge(sorted((tmp_path / "traces").glob("*.pftrace")))))
    assert data.walls == {"rollout-0": (0.0, 7.0)}
    assert sorted(data.spans["rollout-0"]) == [("env.step", 5.0, 7.0), ("model.decode", 0.0, 2.0)]
    assert data.counters == {"rollout-0": {"policy_age": [(3.0, 1.5)]}}

    trace = read_trace(merge([a.path]))
    [end] = [
        i
        for i, p in enumerate(trace.packet)
        if p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_SLICE_END
    ]
    del trace.packet[end]  # the decode's SLICE_END
    assert parse_trace(trace).spans == {}


# --- a synthetic run, end to end -----------------------------------------------------------


def _drawn(plot_figure: object) -> list[tuple[str, list[list[float]], int]]:
    """Per axis of a figure: its ylabel, the y data of each line, and its bar count."""
    out = []
    for ax in plot_figure.axes:  # type: ignore[attr-defined]
        lines = [[float(y) for y in line.get_ydata()] for line in ax.get_lines()]
        bars = sum(1 for p in ax.patches if isinstance(p, Rectangle) and p.get_width() > 0)
        out.append((ax.get_ylabel(), lines, bars))
    return out


def test_report_of_a_synthetic_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_synthetic_run(run_dir)
    (run_dir / "summary.json").write_text(
        json.dumps({"run": "synthetic", "trainer_steps": 12, "groups": 12, "rewards_per_step": []})
    )
    assert cli.main(["report", str(run_dir)]) == 0
    out = run_dir / "report"
    names = ["reward", "throughput", "policy_age", "queues", "time_breakdown"]
    for name in names:
        assert (out / f"{name}.png").stat().st_size > 10_000

    plots = {p.name: p for p in figures(load_run(run_dir))}
    assert list(plots) == names
    for p in plots.values():
        assert p.figure is not None
        for ylabel, lines, bars in _drawn(p.figure):
            assert lines or bars, f"{p.name}: axis {ylabel!r} drew nothing"
            assert all(len(y) > 0 for y in lines), f"{p.name}: an empty line on {ylabel!r}"

    reward, solve = _drawn(plots["reward"].figure)
    assert reward[1][0][:2] == pytest.approx([0.2, 0.21]) and solve[1][0][-1] == pytest.approx(0.5)
    [(_, rates, _)] = _drawn(plots["throughput"].figure)
    assert len(rates) == 4  # trajectories/min of two rollouts, groups/min, examples/min
    depth, lag = _drawn(plots["queues"].figure)
    assert len(depth[1]) == 4 and len(lag[1]) == 1
    assert max(max(y) for y in depth[1]) == pytest.approx(17.0)  # groups: 2 + 60 / 4
    [(_, _, bars)] = _drawn(plots["time_breakdown"].figure)
    assert bars >= 6  # every worker has at least its "other" or "busy" bar
    assert plots["throughput"].missing == []

    md = (out / "report.md").read_text()
    assert "**trainer**: its input queue `groups` grew +15.0 entries/min" in md
    for name in names:
        assert f"]({name}.png)" in md
    assert "| trainer-0 | 120.0 | 0% | 55% | 40% | 0% | 0% | 5% |" in md
    assert "| rollout-0 | 120.0 | 0% | 90% | 0% | 5% | 5% | 0% |" in md
    assert "| feeder-0 | 120.0 |" not in md  # counters alone: nothing known of its time
    assert "| tool.exec | 24 |" in md
    assert "| trainer steps | 12 | summary.json |" in md
    assert "| train.step spans | 12 | trace |" in md
    assert "| examples_total | 96 | trace (last sample) |" in md  # 8 * (120 // 10)
    assert "| trainer-0 | 1,020 | 4,000 |" in md  # rss_mb's max: it wrote no rss_peak_mb
    assert "| rollout-0 | 1,320 | - |" in md
    assert "Not in the plots" not in md


def test_report_of_a_run_without_counters_or_tools(tmp_path: Path) -> None:
    """Spans alone, no tools, no summary.json: the counter plots are left out and named,
    the bottleneck falls back to the worker idle the least (rollout-0, 90 % decoding)."""
    run_dir = tmp_path / "run"
    write_synthetic_run(run_dir, counters=False, tools=False)
    (run_dir / "report").mkdir()
    (run_dir / "report" / "queues.png").write_bytes(b"an earlier run's plot")
    md = write_report(run_dir).read_text()
    out = run_dir / "report"
    assert sorted(p.name for p in out.glob("*.png")) == ["time_breakdown.png"]
    assert "**rollout**: rollout-0 is idle the least: busy 90% of its wall time" in md
    assert "no queue depths recorded" in md
    assert "No tool calls in the trace" in md
    assert "No summary.json" in md
    assert "- queues.png not drawn: `queue.<stream>.depth`, `queue.<stream>.lag`" in md
    assert "- reward.png not drawn: `reward_mean`, `solve_rate`" in md


def test_report_of_an_empty_run_dir_and_a_missing_one(tmp_path: Path) -> None:
    md = write_report(tmp_path).read_text()
    assert "None named" in md and "No trace files" in md
    assert cli.main(["report", str(tmp_path / "nope")]) == 2


def test_report_of_a_run_with_summary_json_alone(tmp_path: Path) -> None:
    """No trace files (a run before tracing): the reward plot falls back on summary.json's
    per-step rewards, and the figures table shows summary.json's."""
    summary = {
        "run": "old",
        "trainer_steps": 2,
        "mean_reward_first": 0.1234,
        "rewards_per_step": [0.1, 0.3],
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    md = write_report(tmp_path).read_text()
    assert "No trace files in RUN_DIR/traces" in md
    assert "| trainer steps | 2 | summary.json |" in md
    assert "| reward, first steps -> last steps | 0.123 -> None | summary.json |" in md
    assert sorted(p.name for p in (tmp_path / "report").glob("*.png")) == ["reward.png"]
    reward = figures(load_run(tmp_path))[0]
    assert reward.figure is not None
    [(ylabel, lines, _)] = _drawn(reward.figure)
    assert (ylabel, lines) == ("reward (mean)", [[0.1, 0.3]])


def test_report_plots_and_tables_the_held_out_evaluations(tmp_path: Path) -> None:
    """RUN_DIR/eval/step-N.json (trainer.eval_every): the first plot, solve rate by step
    with its interval, and a table."""
    (tmp_path / "summary.json").write_text(json.dumps({"run": "ev", "trainer_steps": 10}))

    def rate(v: float, lo: float, hi: float) -> dict[str, float]:
        return {"value": v, "lo": lo, "hi": hi, "n": 100}

    for step, v in ((0, 0.0), (5, 0.4), (10, 0.95)):
        greedy = {
            "solve_rate": rate(v, max(0.0, v - 0.1), min(1.0, v + 0.05)),
            "reward_mean": rate(v, v, v),
            "tool_call_wellformed_rate": None if step == 0 else rate(0.9, 0.8, 0.95),
            "turns_mean": rate(2.0, 2.0, 2.0),
        }
        evalrun.write_result(
            evalrun.eval_dir(tmp_path),
            step,
            {"step": step, "solve_rate": v, "n": 100, "greedy": greedy},
        )
    md = write_report(tmp_path).read_text()
    plots = figures(load_run(tmp_path))
    assert plots[0].name == "heldout" and plots[0].figure is not None
    [(ylabel, lines, _)] = _drawn(plots[0].figure)
    assert ylabel == "held-out solve rate" and lines == [[0.0, 0.4, 0.95]]
    assert (tmp_path / "report" / "heldout.png").stat().st_size > 10_000
    assert "| 10 | 0.950 [0.850, 1.000] | 100 | 0.950 | 0.900 | 2.00 |" in md
    assert "| 0 | 0.000 [0.000, 0.050] | 100 | 0.000 | - | 2.00 |" in md
