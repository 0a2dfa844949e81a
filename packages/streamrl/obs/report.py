"""`streamrl report RUN_DIR`: plots and a Markdown summary of a finished (or running) run, read
from its files alone: the workers' trace files (`RUN_DIR/traces/*.pftrace`, merged) and
`RUN_DIR/summary.json` when the launcher wrote one. No Redis.

The analysis is pure functions, each tested on hand-worked values:
  spans -> intervals per category -> `breakdown` (union per category over a worker's wall
  time, precedence starting > busy > tools > weight_wait > input_wait, the rest "other");
  counter samples -> `slope` over the run's second half -> `bottleneck` (the stage whose
  input queue grows fastest, else the worker idle the least).
The plots are built by `figures` as matplotlib `Figure`s (Agg, no pyplot state), so a test
reads back what each axis drew; `write_report` saves them and `report.md` beside them.
What the trace lacks (a counter nobody wrote, a run with no tools) is left out of the
plots and named in report.md, never an error.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

from streamrl.evaluation import watch as evalrun
from streamrl.names import RunPaths
from streamrl.obs import metrics as m
from streamrl.obs.metrics import percentile
from streamrl.obs.tracing import Span, merge, read_trace, trace_files, tracks_of

# Counter names read here (the metrics sampler writes them; the issue-16 contract).
REWARD_COUNTERS = (m.REWARD_MEAN, m.SOLVE_RATE)
RATE_COUNTERS = (m.TRAJECTORIES_PER_MIN, m.GROUPS_PER_MIN, m.EXAMPLES_PER_MIN)
AGE_COUNTERS = (m.POLICY_AGE, m.POLICY_AGE_MAX)
MEMORY_PEAKS = ((m.RSS_PEAK_MB, m.RSS_MB), (m.DEVICE_MEM_PEAK_MB, m.DEVICE_MEM_MB))
QUEUE_COUNTER = re.compile(r"^queue\.(?P<stream>[\w-]+)\.(?P<kind>depth|lag)$")

# Which stage reads each stream: the stage a growing queue waits on.
CONSUMER = {"tasks": "rollout", "trajectories": "grouper", "groups": "trainer", "tools": "tools"}

# The time breakdown: span name -> category, and the order a moment is claimed in.
CATEGORIES = ("starting", "busy", "input_wait", "weight_wait", "tools", "other")
PRECEDENCE = ("starting", "busy", "tools", "weight_wait", "input_wait")
_SPAN_CATEGORY = {
    Span.WORKER_START: "starting",
    Span.MODEL_DECODE: "busy",
    Span.TOOL_EXEC: "busy",
    Span.TRAIN_STEP: "busy",
    Span.WEIGHTS_PUBLISH: "busy",
    Span.ROLLOUT_INPUT_WAIT: "input_wait",
    Span.TRAINER_BATCH_WAIT: "input_wait",
    Span.WEIGHTS_LOCK_WAIT: "weight_wait",
    Span.WEIGHTS_LOAD: "weight_wait",
    Span.TOOL_WAIT: "tools",
    Span.ENV_STEP: "tools",
}
TOOL_SPANS = (Span.TOOL_WAIT, Span.TOOL_QUEUE, Span.TOOL_EXEC)

# A queue grows when its fitted rise over the run's second half is at least this many
# entries and this fraction of its mean depth there (a depth that wobbles is not growing).
MIN_RISE_ENTRIES = 2.0
MIN_RISE_FRACTION = 0.1
MIN_SAMPLES = 3

Interval = tuple[float, float]
Samples = list[tuple[float, float]]  # (seconds since the run's first event, value), by time


def category(span_name: str) -> str | None:
    """The breakdown category of a span (`checkpoint.*` is busy), None for the rest."""
    if span_name.startswith("checkpoint."):
        return "busy"
    return _SPAN_CATEGORY.get(span_name)


# --- intervals ---------------------------------------------------------------------------


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly what `intervals` cover (touching ones
    join; empty ones vanish)."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """What of `a` lies outside `b` (both sorted and disjoint, as `union` returns them)."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def breakdown(spans: Iterable[tuple[str, float, float]], wall: Interval) -> dict[str, float]:
    """Seconds of `wall` in each of CATEGORIES, from (name, start, end) spans: the union of a
    category's spans, less what a category before it in PRECEDENCE holds; "other" is the
    rest. The values sum to the wall time."""
    by_cat: dict[str, list[Interval]] = defaultdict(list)
    for name, start, end in spans:
        cat = category(name)
        if cat is not None:
            by_cat[cat].append((max(start, wall[0]), min(end, wall[1])))
    claimed: list[Interval] = []
    out = dict.fromkeys(CATEGORIES, 0.0)
    for cat in PRECEDENCE:
        mine = subtract(union(by_cat[cat]), claimed)
        out[cat] = length(mine)
        claimed = union([*claimed, *mine])
    out["other"] = max(0.0, (wall[1] - wall[0]) - length(claimed))
    return out


# --- series ------------------------------------------------------------------------------


def slope(samples: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of value over time (units per second); 0 for fewer than two
    distinct times."""
    if len(samples) < 2:
        return 0.0
    t = np.array([s[0] for s in samples], dtype=np.float64)
    v = np.array([s[1] for s in samples], dtype=np.float64)
    dt = t - t.mean()
    denom = float((dt * dt).sum())
    return float((dt * (v - v.mean())).sum() / denom) if denom > 0 else 0.0


@dataclass(frozen=True)
class QueueTrend:
    stream: str
    slope_per_min: float  # fitted over the second half
    rise: float  # slope times the second half's length: entries gained there
    mean_depth: float
    samples: int

    @property
    def grows(self) -> bool:
        return (
            self.samples >= MIN_SAMPLES
            and self.rise >= MIN_RISE_ENTRIES
            and self.rise >= MIN_RISE_FRACTION * self.mean_depth
        )


def queue_trends(depths: Mapping[str, Samples], run: Interval) -> list[QueueTrend]:
    """Each stream's depth trend over the second half of `run` (seconds), fastest first."""
    mid = (run[0] + run[1]) / 2
    out = []
    for stream, samples in depths.items():
        late = [s for s in samples if s[0] >= mid]
        per_s = slope(late)
        mean = float(np.mean([v for _, v in late])) if late else 0.0
        out.append(QueueTrend(stream, per_s * 60, per_s * (run[1] - mid), mean, len(late)))
    return sorted(out, key=lambda q: -q.slope_per_min)


@dataclass(frozen=True)
class Bottleneck:
    stage: str
    worker: str | None  # the worker idle the least, when named by busy fraction
    why: str


def stage_of(worker: str) -> str:
    """`rollout-0` -> `rollout`."""
    return re.sub(r"-\d+$", "", worker)


def bottleneck(
    trends: Sequence[QueueTrend], breakdowns: Mapping[str, Mapping[str, float]]
) -> Bottleneck | None:
    """The stage whose input queue grows fastest over the run's second half; else the worker
    with the highest busy fraction of its wall time; None when the trace has neither."""
    stages = {stage_of(w) for w in breakdowns}
    for q in trends:  # fastest first
        if q.grows and q.stream in CONSUMER:
            stage = CONSUMER[q.stream]
            if stage not in stages and "colocated" in stages and stage in ("rollout", "trainer"):
                stage = "colocated"
            return Bottleneck(
                stage,
                None,
                f"its input queue `{q.stream}` grew {q.slope_per_min:+.1f} entries/min over the "
                f"run's second half (+{q.rise:.0f} entries), the fastest-growing queue",
            )
    busy = {  # of the time after its start (a warm start is not the steady state)
        w: b["busy"] / total
        for w, b in breakdowns.items()
        if (total := sum(b.values()) - b.get("starting", 0.0)) > 0 and b["busy"] > 0
    }
    if not busy:
        return None
    worker = max(sorted(busy), key=lambda w: busy[w])
    grew = "no queue grew over the run's second half" if trends else "no queue depths recorded"
    return Bottleneck(
        stage_of(worker),
        worker,
        f"{worker} is idle the least: busy {busy[worker]:.0%} of its wall time after its "
        f"start ({grew})",
    )


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> list[float]:
    """Linear-interpolated percentiles (numpy's default) of `values`, as the workers'
    counters compute theirs (`metrics.percentile`)."""
    ordered = sorted(values)
    return [percentile(ordered, q) for q in qs]


# --- reading a run -----------------------------------------------------------------------


@dataclass
class RunData:
    """What a run's trace holds, times in seconds since its first event."""

    spans: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)  # worker ->
    counters: dict[str, dict[str, Samples]] = field(default_factory=dict)  # worker -> name ->
    walls: dict[str, Interval] = field(default_factory=dict)  # worker -> first..last event
    t0_ns: int = 0
    summary: dict[str, Any] | None = None
    trace_files: int = 0
    evals: list[dict[str, Any]] = field(default_factory=list)  # RUN_DIR/eval/step-N.json

    @property
    def run(self) -> Interval:
        if not self.walls:
            return (0.0, 0.0)
        return (min(w[0] for w in self.walls.values()), max(w[1] for w in self.walls.values()))

    def series(self, name: str) -> dict[str, Samples]:
        """Worker -> samples of counter `name`, for the workers that wrote it."""
        return {w: c[name] for w, c in sorted(self.counters.items()) if name in c}

    def pooled(self, name: str) -> Samples:
        """Every worker's samples of `name` in one series (a queue's depth read by several)."""
        return sorted(s for samples in self.series(name).values() for s in samples)

    def queues(self, kind: str) -> dict[str, Samples]:
        """Stream -> pooled samples of `queue.<stream>.<kind>`."""
        names = {n for c in self.counters.values() for n in c}
        out = {}
        for name in sorted(names):
            m = QUEUE_COUNTER.match(name)
            if m and m["kind"] == kind:
                out[m["stream"]] = self.pooled(name)
        return out


def _tracks(trace: Trace) -> tuple[dict[int, str], dict[int, str]]:
    """Track uuid -> its worker (the process name of the process above it), and counter
    track uuid -> the counter's name."""
    names = tracks_of(trace)
    process = {uuid: name or f"pid-{pid}" for uuid, (pid, name) in names.process.items()}
    parent = names.parent
    worker_of = {}
    for uuid in {*process, *parent}:
        track, hops = uuid, 0
        while track not in process and track in parent and hops < 16:
            track, hops = parent[track], hops + 1
        worker_of[uuid] = process.get(track, "unknown")
    return worker_of, names.counter


def parse_trace(trace: Trace) -> RunData:
    """Spans (SLICE_BEGIN/END pairs per track) and counter samples per worker (the process
    name of the track's process: a restarted worker's processes count as one worker). A
    slice cut off before its end (a killed worker) is dropped."""
    worker_of, counter_name = _tracks(trace)
    events = [p for p in trace.packet if p.HasField("track_event")]
    t0 = min((p.timestamp for p in events), default=0)
    data = RunData(t0_ns=t0)
    opened: dict[int, list[tuple[str, int]]] = defaultdict(list)
    seen: dict[str, list[int]] = {}  # worker -> [first, last] event time
    for p in events:
        e, ts = p.track_event, p.timestamp
        w = worker_of.get(e.track_uuid, "unknown")
        span = seen.setdefault(w, [ts, ts])
        span[0], span[1] = min(span[0], ts), max(span[1], ts)
        if e.type == TrackEvent.TYPE_SLICE_BEGIN:
            opened[e.track_uuid].append((e.name, ts))
        elif e.type == TrackEvent.TYPE_SLICE_END and opened[e.track_uuid]:
            name, start = opened[e.track_uuid].pop()
            data.spans.setdefault(w, []).append((name, (start - t0) / 1e9, (ts - t0) / 1e9))
        elif e.type == TrackEvent.TYPE_COUNTER and e.track_uuid in counter_name:
            value = (
                float(e.counter_value) if e.HasField("counter_value") else e.double_counter_value
            )
            series = data.counters.setdefault(w, {}).setdefault(counter_name[e.track_uuid], [])
            series.append(((ts - t0) / 1e9, value))
    data.walls = {w: ((a - t0) / 1e9, (b - t0) / 1e9) for w, (a, b) in sorted(seen.items())}
    for by_name in data.counters.values():
        for samples in by_name.values():
            samples.sort()
    return data


def load_run(run_dir: Path) -> RunData:
    """The merged trace files of `run_dir` and its summary.json (either may be missing)."""
    paths = trace_files(run_dir)
    data = parse_trace(read_trace(merge(paths))) if paths else RunData()
    data.trace_files = len(paths)
    summary_path = RunPaths(run_dir).summary
    if summary_path.exists():
        data.summary = json.loads(summary_path.read_text())
    data.evals = evalrun.read_results(evalrun.eval_dir(run_dir))
    return data


# --- figures -----------------------------------------------------------------------------


@dataclass
class Plot:
    """One PNG: its figure (None when there was nothing to draw) and what it lacks."""

    name: str
    title: str
    figure: Figure | None
    missing: list[str] = field(default_factory=list)


def _time_axis(run: Interval) -> tuple[float, str]:
    """Divisor and label: seconds for runs up to 10 minutes, minutes beyond."""
    return (1.0, "time since first event (s)") if run[1] <= 600 else (60.0, "time (min)")


def _legend(ax: Axes) -> None:
    """Beside the axes, where it hides no line (rates are often flat at the top)."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _lines(ax: Axes, series: Mapping[str, Samples], scale: float) -> None:
    for key, samples in series.items():
        ax.plot([t / scale for t, _ in samples], [v for _, v in samples], label=key)


def _panels(
    data: RunData, name: str, title: str, panels: Sequence[tuple[str, Sequence[str]]]
) -> Plot:
    """A figure of one panel per (ylabel, counters) with data, a line per counter and
    worker; counters nobody wrote are named in `missing`, a panel with none is left out."""
    present = [(ylabel, [c for c in names if data.series(c)]) for ylabel, names in panels]
    missing = [c for _, names in panels for c in names if not data.series(c)]
    present = [(ylabel, names) for ylabel, names in present if names]
    if not present:
        return Plot(name, title, None, missing)
    scale, xlabel = _time_axis(data.run)
    fig = Figure(figsize=(9, 3.2 * len(present)), layout="constrained")
    axes = fig.subplots(len(present), 1, squeeze=False)[:, 0]
    for ax, (ylabel, names) in zip(axes, present, strict=True):
        workers = sorted({w for c in names for w in data.series(c)})
        for k, c in enumerate(names):
            series = data.series(c)
            for w in series:
                ax.plot(
                    [t / scale for t, _ in series[w]],
                    [v for _, v in series[w]],
                    ("-", "--", ":")[k % 3],
                    color=f"C{workers.index(w) % 10}",
                    label=f"{c} {w}" if len(names) > 1 else w,
                )
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        _legend(ax)
    axes[-1].set_xlabel(xlabel)
    fig.suptitle(title)
    return Plot(name, title, fig, missing)


def _reward_plot(data: RunData) -> Plot:
    plot = _panels(
        data,
        "reward",
        "Reward and solve rate",
        [("reward (mean)", ["reward_mean"]), ("solve rate", ["solve_rate"])],
    )
    steps = (data.summary or {}).get("rewards_per_step") or []
    if plot.figure is None and steps:  # no counters: the trainer's per-step rewards
        fig = Figure(figsize=(9, 3.2), layout="constrained")
        ax = fig.subplots()
        ax.plot(range(1, len(steps) + 1), steps, marker="o", label="reward_mean per step")
        ax.set_xlabel("trainer step")
        ax.set_ylabel("reward (mean)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        plot.title = "Reward per trainer step (summary.json: no reward counters in the trace)"
        fig.suptitle(plot.title)
        plot.figure = fig
    return plot


def _queue_plot(data: RunData) -> Plot:
    title = "Queue depths and lags"
    depth, lag = data.queues("depth"), data.queues("lag")
    panels = [(lbl, s) for lbl, s in (("depth (entries)", depth), ("lag (entries)", lag)) if s]
    if not panels:
        return Plot("queues", title, None, ["queue.<stream>.depth", "queue.<stream>.lag"])
    scale, xlabel = _time_axis(data.run)
    fig = Figure(figsize=(9, 3.2 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (ylabel, series) in zip(axes, panels, strict=True):
        _lines(ax, series, scale)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        _legend(ax)
    axes[-1].set_xlabel(xlabel)
    fig.suptitle(title)
    missing = [] if lag else ["queue.<stream>.lag"]
    return Plot("queues", title, fig, missing if depth else ["queue.<stream>.depth", *missing])


COLORS = {
    "starting": "#495057",
    "busy": "#2b8a3e",
    "input_wait": "#e8590c",
    "weight_wait": "#7048e8",
    "tools": "#1c7ed6",
    "other": "#adb5bd",
}


def _breakdown_plot(breakdowns: Mapping[str, Mapping[str, float]]) -> Plot:
    title = "Where each worker's time went (fraction of its wall time)"
    rows = [w for w in sorted(breakdowns) if sum(breakdowns[w].values()) > 0]
    if not rows:
        return Plot("time_breakdown", title, None, ["spans"])
    fig = Figure(figsize=(9, 1.2 + 0.45 * len(rows)), layout="constrained")
    ax = fig.subplots()
    left = np.zeros(len(rows))
    for cat in CATEGORIES:
        frac = np.array([breakdowns[w][cat] / sum(breakdowns[w].values()) for w in rows])
        bars = ax.barh(rows, frac, left=left, color=COLORS[cat], label=cat)
        labels = [f"{f:.0%}" if f >= 0.06 else "" for f in frac]
        ax.bar_label(bars, labels=labels, label_type="center", fontsize=8, color="white")
        left += frac
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("fraction of wall time")
    ax.legend(ncols=len(CATEGORIES), fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(title)
    return Plot("time_breakdown", title, fig)


def breakdowns_of(data: RunData) -> dict[str, dict[str, float]]:
    """The time breakdown of each worker that wrote spans (one with counters alone tells
    nothing of its time)."""
    return {w: breakdown(data.spans[w], wall) for w, wall in data.walls.items() if w in data.spans}


def _heldout_plot(data: RunData) -> Plot:
    """Held-out greedy solve rate (trainer.eval_every) against trainer step, with its 95 %
    interval."""
    title = "Held-out solve rate (greedy) by trainer step"
    fig = Figure(figsize=(9, 3.2), layout="constrained")
    ax = fig.subplots()
    steps = [r["step"] for r in data.evals]
    rates = [r["solve_rate"] for r in data.evals]
    lo = [r["greedy"]["solve_rate"]["lo"] for r in data.evals]
    hi = [r["greedy"]["solve_rate"]["hi"] for r in data.evals]
    ax.fill_between(steps, lo, hi, alpha=0.2, label="95% interval")
    ax.plot(steps, rates, marker="o", label=f"solve rate ({data.evals[-1]['n']} tasks)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("held-out solve rate")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    return Plot("heldout", title, fig)


def figures(data: RunData) -> list[Plot]:
    """Every plot of the report, in order (`figure` None where the trace had nothing); the
    held-out plot first when the run evaluated (RUN_DIR/eval)."""
    return [
        *([_heldout_plot(data)] if data.evals else []),
        _reward_plot(data),
        *([_tasks_plot(data)] if _tasks_of(data) else []),
        _panels(
            data,
            "throughput",
            "Throughput (rates over the sliding window)",
            [("per minute", RATE_COUNTERS)],
        ),
        _panels(
            data,
            "policy_age",
            "Policy age (versions behind the trainer)",
            [("versions", AGE_COUNTERS)],
        ),
        _queue_plot(data),
        _breakdown_plot(breakdowns_of(data)),
    ]


# --- report.md ---------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _num(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def _maybe(x: object) -> str:
    return _num(x) if isinstance(x, int | float) else str(x)


def _last(samples: Samples) -> float:
    return samples[-1][1]


TOTAL_COUNTERS = (m.TRAJECTORIES_TOTAL, m.GROUPS_TOTAL, m.EXAMPLES_TOTAL, m.POLICY_VERSION)


def _summary_lines(data: RunData) -> list[str]:
    """The run's figures: summary.json's (when the launcher wrote one), then the trace's own
    (train.step spans, the totals' and policy version's last samples, highest worker's)."""
    rows: list[tuple[str, object, str]] = []
    s = data.summary
    if s is not None:
        src = "summary.json"
        rows += [
            ("exit", s.get("exit_reason", "?"), src),
            ("elapsed", f"{s.get('elapsed_s', 0)} s", src),
            ("trainer steps", s.get("trainer_steps"), src),
            ("policy version", s.get("policy_version"), src),
            ("trajectories", s.get("trajectories"), src),
            (
                "groups (trained / dropped)",
                f"{s.get('groups')} ({s.get('groups_trained')} / {s.get('groups_dropped')})",
                src,
            ),
            ("tool calls (errors)", f"{s.get('tool_calls')} ({s.get('tool_errors')})", src),
            ("dead letters", s.get("dead_letters"), src),
            (
                "reward, first steps -> last steps",
                f"{_maybe(s.get('mean_reward_first'))} -> {_maybe(s.get('mean_reward_last'))}",
                src,
            ),
            ("worker restarts", sum((s.get("worker_restarts") or {}).values()), src),
        ]
    steps = sum(1 for spans in data.spans.values() for n, _, _ in spans if n == "train.step")
    rows.append(("train.step spans", steps, "trace"))
    for c in TOTAL_COUNTERS:
        lasts = [_last(samples) for samples in data.series(c).values()]
        if lasts:
            rows.append((c, _num(max(lasts)), "trace (last sample)"))
    lines = (
        []
        if s
        else [
            "No summary.json (the run was not stopped by `streamrl up`, or is "
            "still running): the trace's figures alone.",
            "",
        ]
    )
    return [*lines, *_table(("figure", "value", "from"), rows)]


def _heldout_lines(data: RunData) -> list[str]:
    if not data.evals:
        return ["No held-out evaluations (trainer.eval_every = 0)."]
    rows = []
    for r in data.evals:
        g = r["greedy"]
        wf = g.get("tool_call_wellformed_rate")
        rows.append(
            (
                r["step"],
                f"{g['solve_rate']['value']:.3f} [{g['solve_rate']['lo']:.3f}, "
                f"{g['solve_rate']['hi']:.3f}]",
                r["n"],
                f"{g['reward_mean']['value']:.3f}",
                "-" if wf is None else f"{wf['value']:.3f}",
                f"{g['turns_mean']['value']:.2f}",
            )
        )
    header = ["step", "solve rate [95%]", "tasks", "mean reward", "well-formed calls", "turns"]
    return _table(header, rows)


def _tasks_of(data: RunData) -> dict[str, dict[str, Any]]:
    """A mixture's `tasks` block of summary.json (`run.summary.task_summary`), or {}."""
    return dict((data.summary or {}).get("tasks") or {})


def _task_lines(data: RunData) -> list[str]:
    """A mixture's figures per task, from summary.json."""
    rows = []
    for label, t in _tasks_of(data).items():
        rows.append(
            (
                f"`{label}`",
                t.get("tasks", 0),
                t.get("trajectories", 0),
                " / ".join(
                    str(t.get(k, 0)) for k in ("groups", "groups_trained", "groups_dropped")
                ),
                f"{_maybe(t.get('mean_reward_first'))} -> {_maybe(t.get('mean_reward_last'))}",
                _maybe(t.get("eval_solve_rate_last")),
            )
        )
    header = ("task", "tasks written", "trajectories", "groups (emitted / trained / dropped)",
              "reward, first steps -> last steps", "held-out solve rate (last)")  # fmt: skip
    return _table(header, rows)


def _tasks_plot(data: RunData) -> Plot:
    """A mixture's reward and solve rate per trainer step, one line per task."""
    title = "Reward and solve rate per task (trainer steps)"
    tasks = _tasks_of(data)
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    reward_ax, solve_ax = fig.subplots(2, 1, sharex=True)
    for label, t in tasks.items():
        for ax, key in ((reward_ax, "rewards_per_step"), (solve_ax, "solve_rate_per_step")):
            points = t.get(key) or []
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label)
    reward_ax.set_ylabel("reward (mean)")
    solve_ax.set_ylabel("solve rate")
    solve_ax.set_xlabel("trainer step")
    for ax in (reward_ax, solve_ax):
        _legend(ax)
    fig.suptitle(title)
    return Plot("tasks", title, fig)


def _rates_lines(data: RunData) -> list[str]:
    rows = [
        (c, w, _num(_last(samples)))
        for c in (*RATE_COUNTERS, *REWARD_COUNTERS)
        for w, samples in data.series(c).items()
    ]
    if not rows:
        return ["No rate counters in the trace."]
    return _table(("counter (last sample)", "worker", "value"), rows)


def _age_lines(data: RunData) -> list[str]:
    rows = [
        (
            w,
            _num(_last(ages)),
            _num(
                max((v for _, v in data.series("policy_age_max").get(w, [])), default=float("nan"))
            ),
        )
        for w, ages in data.series("policy_age").items()
    ]
    if not rows:
        return ["No policy_age counter in the trace."]
    return _table(("worker", "policy age (last window mean)", "policy age max (run)"), rows)


def _queue_lines(trends: Sequence[QueueTrend]) -> list[str]:
    if not trends:
        return ["No queue.<stream>.depth counter in the trace."]
    rows = [
        (
            f"`{q.stream}`",
            CONSUMER.get(q.stream, "?"),
            f"{q.slope_per_min:+.2f}",
            f"{q.rise:+.1f}",
            _num(q.mean_depth),
            q.samples,
            "yes" if q.grows else "no",
        )
        for q in trends
    ]
    header = ("queue", "read by", "slope (entries/min)", "rise", "mean depth", "samples", "grows")
    return [
        "Depth trends over the run's second half (least-squares fit):",
        "",
        *_table(header, rows),
    ]


def _tool_lines(data: RunData) -> list[str]:
    durations: dict[str, list[float]] = defaultdict(list)
    for spans in data.spans.values():
        for name, start, end in spans:
            if name in TOOL_SPANS:
                durations[name].append(end - start)
    if not durations:
        return ["No tool calls in the trace (no tool.wait, tool.queue or tool.exec spans)."]
    rows = [
        (name, len(durations[name]), *(f"{p:.3f}" for p in percentiles(durations[name])))
        for name in TOOL_SPANS
        if durations[name]
    ]
    return _table(("span", "calls", "p50 (s)", "p90 (s)", "p99 (s)"), rows)


def _memory_lines(data: RunData) -> list[str]:
    rows = []
    for w in sorted(data.counters):
        peaks = []
        for peak, current in MEMORY_PEAKS:
            samples = data.counters[w].get(peak) or data.counters[w].get(current) or []
            peaks.append(_num(max(v for _, v in samples)) if samples else "-")
        if any(p != "-" for p in peaks):
            rows.append((w, *peaks))
    if not rows:
        return ["No memory counters (rss_mb, device_mem_mb) in the trace."]
    return _table(("worker", "RSS peak (MB)", "device memory peak (MB)"), rows)


def _breakdown_lines(breakdowns: Mapping[str, Mapping[str, float]]) -> list[str]:
    rows = []
    for w, b in breakdowns.items():
        total = sum(b.values())
        if total > 0:
            rows.append((w, f"{total:.1f}", *(f"{b[c] / total:.0%}" for c in CATEGORIES)))
    if not rows:
        return ["No spans in the trace."]
    return _table(("worker", "wall (s)", *CATEGORIES), rows)


def render_markdown(data: RunData, plots: Sequence[Plot], title: str) -> str:
    """report.md: the run's figures, the bottleneck, and the plots saved beside it."""
    breakdowns = breakdowns_of(data)
    trends = queue_trends(data.queues("depth"), data.run)
    neck = bottleneck(trends, breakdowns)
    n_spans = sum(len(s) for s in data.spans.values())
    lines = [
        f"# Run report: {title}",
        "",
        f"{data.trace_files} trace files, {len(data.walls)} workers, {n_spans} spans, "
        f"{data.run[1] - data.run[0]:.1f} s from the first event to the last."
        if data.trace_files
        else "No trace files in RUN_DIR/traces: the figures below are summary.json's alone.",
        "",
        "## Bottleneck",
        "",
        f"**{neck.stage}**: {neck.why}."
        if neck
        else "None named: the trace has neither queue depths nor busy spans.",
        "",
        "## Run",
        "",
        *_summary_lines(data),
        "",
        "## Held-out evaluation (greedy, RUN_DIR/eval)",
        "",
        *_heldout_lines(data),
        "",
        *(["## Tasks of the mixture", "", *_task_lines(data), ""] if _tasks_of(data) else []),
        "## Rates and reward (each counter's last sample)",
        "",
        *_rates_lines(data),
        "",
        "## Policy age",
        "",
        *_age_lines(data),
        "",
        "## Queues",
        "",
        *_queue_lines(trends),
        "",
        "## Tool latency",
        "",
        *_tool_lines(data),
        "",
        "## Memory high-water marks",
        "",
        *_memory_lines(data),
        "",
        "## Time per worker",
        "",
        "Union of spans per category over the worker's wall time (first to last event), "
        "precedence starting > busy > tools > weight_wait > input_wait; the rest is other "
        "(starting: from the worker's first event to its main loop's first turn).",
        "",
        *_breakdown_lines(breakdowns),
        "",
        "## Plots",
        "",
    ]
    for p in plots:
        if p.figure is not None:
            lines += [f"### {p.title}", "", f"![{p.title}]({p.name}.png)", ""]
    absent = [p for p in plots if p.figure is None or p.missing]
    if absent:
        lines += ["## Not in the plots", ""]
        for p in absent:
            what = ", ".join(f"`{m}`" for m in p.missing) or "no data"
            state = "not drawn" if p.figure is None else "drawn without"
            lines.append(f"- {p.name}.png {state}: {what} not in the trace")
        lines.append("")
    return "\n".join(lines)


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the PNGs and report.md of `run_dir` into `out_dir` (default RUN_DIR/report);
    returns report.md's path."""
    out_dir = out_dir or run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    data = load_run(run_dir)
    plots = figures(data)
    for p in plots:
        stale = out_dir / f"{p.name}.png"
        if p.figure is None:
            stale.unlink(missing_ok=True)  # a rerun must not show an earlier run's plot
        else:
            p.figure.savefig(stale, dpi=110)
    title = str((data.summary or {}).get("run") or run_dir.name)
    path = out_dir / "report.md"
    path.write_text(render_markdown(data, plots, title) + "\n")
    return path
