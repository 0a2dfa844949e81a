"""`streamrl status`: a live view of a run from Redis alone, drawn with `rich`.

What it reads, each frame (a handful of round trips, as the operator user):

- every worker's identity slot and liveness beat (`Keys.worker_slot`, `Keys.worker_beat`:
  `streamrl.run.identity`): a worker is `live` while its slot is held and its loop beats,
  `no beat` while its slot is held but its loop has not beaten lately, `gone` when its slot
  lapsed (it stopped or died);
- the newest sample of every worker's counters (`Keys.worker_metrics`: `streamrl.obs.metrics`);
- the run's counters (`Keys.stats`);
- given a run directory, the held-out evaluator's newest result (RUN_DIR/eval, a file:
  the evaluator writes no Redis).

Figures of one kind from several workers combine by what they mean: rates and totals add
up (two groupers' groups per minute), a queue's depth is the largest any reader reports
(each grouper sees the same stream), the policy version the newest, means are averaged.

Where to connect comes from the run directory of `streamrl up` (the embedded Redis's
operator URL and password, the run's name from the launcher's record) or, for a compose
stack, from REDIS_URL (or --redis-url) and the run name of --config.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from streamrl import counters
from streamrl.evaluation import watch as evalrun
from streamrl.jsontypes import JSONObject, integer, json_object, number
from streamrl.names import Keys
from streamrl.obs import metrics as m
from streamrl.obs.metrics import decode_sample
from streamrl.transport import as_str
from streamrl.wire import TaskFigures, TrainMetrics, WireError, decode

SCAN_COUNT = 500
TASK_STEPS = 20  # trainer steps a mixture's per-task reward and solve rate are pooled over
BEAT_FRESH_S = 30.0  # a beat unchanged for longer than this shows as `no beat`


@dataclass
class WorkerState:
    """One worker as the last frame saw it."""

    worker_id: str
    holder: str | None  # who holds its slot (None: lapsed)
    beat: str | None  # its liveness beat's value
    sample_age_s: float | None  # age of its newest counter sample
    values: dict[str, float] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.worker_id.rsplit("-", 1)[0]

    def state(self, beat_age_s: float | None) -> str:
        if self.holder is None:
            return "gone"
        if beat_age_s is not None and beat_age_s > BEAT_FRESH_S:
            return "no beat"
        return "live"


@dataclass
class Snapshot:
    run: str
    workers: list[WorkerState]
    stats: dict[str, str]
    beat_age_s: dict[str, float]  # worker id -> seconds since its beat last changed
    taken_at: float  # unix seconds
    heldout: JSONObject | None = None  # the evaluator's newest result (a run directory)
    # a mixture's reward and solve rate per task over the trainer's last TASK_STEPS steps
    tasks: dict[str, TaskFigures] = field(default_factory=dict)


_SLOT = re.compile(r":worker:([A-Za-z_]+):(\d+)(:beat)?$")


class StatusReader:
    """Reads snapshots of one run; remembers when each beat last changed."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        clock: Callable[[], float] = time.time,
        eval_root: Path | None = None,
    ):
        self.client = client
        self.keys = keys
        self.clock = clock
        self.eval_root = eval_root  # RUN_DIR/eval: the held-out row (files, not Redis)
        self._beats: dict[str, tuple[str, float]] = {}  # worker id -> (beat, first seen)

    def _scan(self, pattern: str) -> list[str]:
        return sorted({as_str(k) for k in self.client.scan_iter(pattern, count=SCAN_COUNT)})

    def read(self) -> Snapshot:
        k = self.keys
        now = self.clock()
        slots: dict[str, str] = {}
        beat_keys: dict[str, str] = {}
        for key in self._scan(k.worker_slots("*")):
            match = _SLOT.search(key)
            if match is None:
                continue
            wid = f"{match.group(1)}-{match.group(2)}"
            if match.group(3):
                beat_keys[wid] = key
            else:
                slots[wid] = key
        series = {key.rsplit(":", 1)[1]: key for key in self._scan(k.every_worker_metrics)}
        ids = sorted(set(slots) | set(series), key=_order)
        pipe = self.client.pipeline(transaction=False)
        for wid in ids:
            pipe.get(slots.get(wid, k.worker_slot(*_split(wid))))
            pipe.get(beat_keys.get(wid, k.worker_beat(*_split(wid))))
            pipe.xrevrange(series.get(wid, k.worker_metrics(wid)), count=1)
        pipe.xrevrange(k.metrics, count=TASK_STEPS)
        pipe.hgetall(k.stats)
        replies = pipe.execute()
        workers = []
        beat_age: dict[str, float] = {}
        for i, wid in enumerate(ids):
            holder, beat, last = replies[3 * i : 3 * i + 3]
            values: dict[str, float] = {}
            age = None
            if last:
                entry_id, fields = last[0]
                age = max(0.0, now - int(as_str(entry_id).split("-")[0]) / 1000)
                values = decode_sample(fields)
            beat_s = None if beat is None else as_str(beat)
            if beat_s is not None:
                seen = self._beats.get(wid)
                if seen is None or seen[0] != beat_s:
                    self._beats[wid] = (beat_s, now)
                beat_age[wid] = now - self._beats[wid][1]
            workers.append(
                WorkerState(wid, None if holder is None else as_str(holder), beat_s, age, values)
            )
        stats = {as_str(a): as_str(b) for a, b in replies[-1].items()}
        heldout = evalrun.latest_result(self.eval_root) if self.eval_root is not None else None
        steps = []
        for _, fields in replies[-2]:
            try:
                steps.append(decode(fields, TrainMetrics))
            except WireError:
                continue  # the summary and the sinks count unreadable entries
        tasks = pooled_task_figures(steps)
        return Snapshot(self.keys.ns, workers, stats, beat_age, now, heldout, tasks)


def pooled_task_figures(steps: Iterable[TrainMetrics]) -> dict[str, TaskFigures]:
    """Each task's figures over several trainer steps: groups and sequences added up,
    reward and solve rate averaged over the sequences."""
    acc: dict[str, list[float]] = {}  # label -> groups, sequences, reward sum, solved sum
    for step in steps:
        for label, f in step.tasks.items():
            a = acc.setdefault(label, [0.0, 0.0, 0.0, 0.0])
            a[0] += f.groups
            a[1] += f.sequences
            a[2] += f.reward_mean * f.sequences
            a[3] += f.solve_rate * f.sequences
    return {
        label: TaskFigures(
            groups=int(g),
            sequences=int(n),
            reward_mean=r / n if n else 0.0,
            solve_rate=sv / n if n else 0.0,
        )
        for label, (g, n, r, sv) in sorted(acc.items())
    }


def _split(worker_id: str) -> tuple[str, int]:
    name, _, index = worker_id.rpartition("-")
    return name, int(index) if index.isdigit() else 0


_KIND_ORDER = ("feeder", "rollout", "colocated", "tools", "grouper", "trainer")


def _order(worker_id: str) -> tuple[int, str, int]:
    name, index = _split(worker_id)
    rank = _KIND_ORDER.index(name) if name in _KIND_ORDER else len(_KIND_ORDER)
    return rank, name, index


# -- combining the workers' figures ------------------------------------------------------------


def _values(workers: Iterable[WorkerState], name: str) -> list[float]:
    return [
        w.values[name]
        for w in workers
        if name in w.values and w.holder is not None and math.isfinite(w.values[name])
    ]


def total(workers: Iterable[WorkerState], name: str) -> float | None:
    xs = _values(workers, name)
    return sum(xs) if xs else None


def largest(workers: Iterable[WorkerState], name: str) -> float | None:
    xs = _values(workers, name)
    return max(xs) if xs else None


def average(workers: Iterable[WorkerState], name: str) -> float | None:
    xs = _values(workers, name)
    return sum(xs) / len(xs) if xs else None


# The rate shown beside each worker type: what it produces.
WORKER_RATE = {
    "rollout": (m.TRAJECTORIES_PER_MIN, "traj/min"),
    "colocated": (m.TRAJECTORIES_PER_MIN, "traj/min"),
    "grouper": (m.GROUPS_PER_MIN, "groups/min"),
    "trainer": (m.EXAMPLES_PER_MIN, "examples/min"),
}


def _fmt(value: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def render(snap: Snapshot) -> Group:
    """One frame: the workers, the queues, the groups and the policy."""
    return Group(
        Text(f"run {snap.run}  ·  {time.strftime('%H:%M:%S', time.localtime(snap.taken_at))}"),
        _workers_table(snap),
        _queues_table(snap),
        _pipeline_table(snap),
        *([_tasks_table(snap)] if len(_task_labels(snap)) > 1 else []),
    )


def _task_labels(snap: Snapshot) -> list[str]:
    """The tasks of a mixture the snapshot shows figures of (one task: no table)."""
    labels = set(counters.by_task(snap.stats)) | set(snap.tasks)
    labels |= set(evalrun.task_results(snap.heldout or {}))
    return sorted(labels)


def _tasks_table(snap: Snapshot) -> Table:
    """A mixture's figures per task: its counters (run), the trainer's last steps' reward
    and solve rate, and the held-out evaluation's solve rate."""
    t = Table(title=f"tasks (reward, solve rate: last {TASK_STEPS} trainer steps)",
              title_justify="left")  # fmt: skip
    cols = ("task", "tasks", "trajectories", "groups", "dropped", "reward", "solve rate",
            "held-out")  # fmt: skip
    for col in cols:
        t.add_column(col, justify="left" if col == "task" else "right")
    counts = counters.by_task(snap.stats)
    heldout = evalrun.task_results(snap.heldout or {})
    for label in _task_labels(snap):
        c = counts.get(label, {})
        f = snap.tasks.get(label)
        h = heldout.get(label)
        t.add_row(
            label,
            *(str(c.get(name, 0)) for name in counters.PER_TASK),
            _fmt(f.reward_mean if f else None, ".3f"),
            _fmt(f.solve_rate if f else None, ".1%"),
            _fmt(number(json_object(h)["solve_rate"]) if h else None, ".2f"),
        )
    return t


def _workers_table(snap: Snapshot) -> Table:
    t = Table(title="workers", title_justify="left")
    for col in ("worker", "state", "sample", "rate", "policy", "rss MB", "device MB"):
        t.add_column(col, justify="left" if col in ("worker", "state") else "right")
    for w in snap.workers:
        state = w.state(snap.beat_age_s.get(w.worker_id))
        style = {"live": "green", "no beat": "yellow", "gone": "red"}[state]
        rate_name, unit = WORKER_RATE.get(w.kind, ("", ""))
        rate = _fmt(w.values.get(rate_name), ".1f", f" {unit}") if rate_name else "-"
        t.add_row(
            w.worker_id,
            Text(state, style=style),
            _fmt(w.sample_age_s, ".1f", " s ago"),
            rate,
            _fmt(w.values.get(m.POLICY_VERSION), ".0f"),
            _fmt(w.values.get(m.RSS_MB), ".0f"),
            _fmt(w.values.get(m.DEVICE_MEM_MB), ".0f"),
        )
    return t


def _queues_table(snap: Snapshot) -> Table:
    t = Table(title="queues", title_justify="left")
    for col in ("queue", "depth", "lag"):
        t.add_column(col, justify="left" if col == "queue" else "right")
    for stream in m.QUEUE_STREAMS:
        depth = largest(snap.workers, m.queue_depth(stream))
        lag = largest(snap.workers, m.queue_lag(stream))
        t.add_row(stream, _fmt(depth, ".0f"), _fmt(lag, ".0f"))
    return t


def _heldout(result: JSONObject | None) -> str:
    if result is None:
        return "-"
    return f"{number(result['solve_rate']):.2f} @ step {integer(result['step'])}"


def _backlog(snap: Snapshot) -> str:
    """The feeder's tasks backlog against the size it keeps, and which side holds the
    run back: tasks queued for rollout (rollout is), or none queued with the backlog full
    (the feeder's backlog is: raise task.max_backlog, or set it to "auto")."""
    depth = largest(snap.workers, m.queue_depth("tasks"))
    lag = largest(snap.workers, m.queue_lag("tasks"))
    target = largest(snap.workers, m.BACKLOG_TARGET)
    if depth is None or target is None:
        return "-"
    if lag:
        limit = "rollout is the limit"
    elif depth >= target:
        limit = "the backlog is the limit"
    else:
        limit = "feeder keeps up"
    return f"{depth:.0f} / {target:.0f} ({limit})"


def _live_lag(snap: Snapshot) -> str:
    """Versions behind a group reaches the trainer at the live rollout capacity (the
    feeder's `streamrl.fit` at the advertised slots), and whether that drops most groups
    as stale (past grouper.off_policy_steps + 1)."""
    lag = largest(snap.workers, m.LIVE_POLICY_LAG)
    limit = largest(snap.workers, m.STALE_LAG_LIMIT)
    if lag is None or limit is None:
        return "-"
    verdict = "most groups dropped as stale" if lag > limit else "fits"
    return f"{lag:.1f} versions (limit {limit:.0f}: {verdict})"


def _pipeline_table(snap: Snapshot) -> Table:
    ws = snap.workers
    trainers = [w for w in ws if w.kind in ("trainer", "colocated")]
    rollouts = [w for w in ws if w.kind in ("rollout", "colocated")]
    rows = [
        ("trajectories/min", _fmt(total(ws, m.TRAJECTORIES_PER_MIN))),
        ("groups/min", _fmt(total(ws, m.GROUPS_PER_MIN))),
        ("examples/min", _fmt(total(ws, m.EXAMPLES_PER_MIN))),
        ("tokens/s", _fmt(total(ws, m.TOKENS_PER_S), ".0f")),
        ("active episodes", _fmt(total(ws, m.ACTIVE_EPISODES), ".0f")),
        ("batch occupancy", _fmt(average(ws, m.ENGINE_BATCH_OCCUPANCY), ".0%")),
        ("half-filled groups", _fmt(largest(ws, m.GROUPS_HALF_FILLED), ".0f")),
        ("oldest half-filled", _fmt(largest(ws, m.OLDEST_HALF_FILLED_S), ".1f", " s")),
        ("policy version", _fmt(largest(trainers, m.POLICY_VERSION), ".0f")),
        ("policy age (trained)", _fmt(average(trainers, m.POLICY_AGE), ".2f")),
        ("policy age max", _fmt(largest(trainers, m.POLICY_AGE_MAX), ".0f")),
        ("reward", _fmt(average(rollouts, m.REWARD_MEAN), ".3f")),
        ("solve rate", _fmt(average(rollouts, m.SOLVE_RATE), ".1%")),
        (
            "tool latency p50/p90/p99",
            "/".join(
                _fmt(largest(rollouts, n), ".3f")
                for n in (m.TOOL_LATENCY_P50_S, m.TOOL_LATENCY_P90_S, m.TOOL_LATENCY_P99_S)
            )
            + " s",
        ),
        (
            "tool errors / timeouts",
            f"{_fmt(average(rollouts, m.TOOL_ERROR_RATE), '.1%')} / "
            f"{_fmt(average(rollouts, m.TOOL_TIMEOUT_RATE), '.1%')}",
        ),
        ("rollout slots (advertised)", _fmt(largest(ws, m.ROLLOUT_SLOTS), ".0f")),
        # rollout.max_concurrency = "auto": the slots above are the adaptive limits
        ("admission trims (run)", snap.stats.get(counters.ADMISSION_TRIMS, "-")),
        ("policy lag at those slots", _live_lag(snap)),
        ("tasks backlog / target", _backlog(snap)),
        ("held-out solve rate", _heldout(snap.heldout)),
        ("trainer steps (run)", snap.stats.get(counters.TRAINER_STEPS, "-")),
        ("groups (run)", snap.stats.get(counters.GROUPS, "-")),
    ]
    t = Table(title="pipeline", title_justify="left", show_header=False)
    t.add_column("figure")
    t.add_column("value", justify="right")
    for name, value in rows:
        t.add_row(name, value)
    return t


def show(
    reader: StatusReader,
    console: Console,
    *,
    once: bool,
    every_s: float = 1.0,
    frames: int = 0,
) -> None:
    """Draw one frame (`once`), or redraw every `every_s` until interrupted (or after
    `frames` frames, when not 0)."""
    if once:
        console.print(render(reader.read()))
        return
    shown = 0
    with Live(render(reader.read()), console=console, auto_refresh=False) as live:
        try:
            while not frames or shown < frames:
                time.sleep(every_s)
                live.update(render(reader.read()), refresh=True)
                shown += 1
        except KeyboardInterrupt:
            pass
