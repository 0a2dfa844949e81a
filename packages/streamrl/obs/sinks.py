"""Metrics sinks (issue 32): the run's figures in TensorBoard and W&B, the trainer step as
the x axis, written by one process from what the run already records.

Turn them on with `[logging] sinks = ["tensorboard", "wandb"]` (or `--set
'logging.sinks=["tensorboard","wandb"]'`); none by default.

Who writes. One process: the `sinks` worker (`streamrl worker sinks`, workers/sinks.py),
which `streamrl up` starts when `logging.sinks` names any sink and which the compose stack
runs as its `sinks` service (profile `sinks`). No other worker knows about sinks. A worker
of its own rather than the launcher: compose has no launcher, and as a worker it gets what
every worker gets (an identity slot, a liveness beat, restarts, its own Redis user, which
reads the trainer's metrics and the counters and writes nothing of the run), and its
imports (tensorboardX, wandb) and its writes stay out of the launcher, which supervises
the run. `streamrl up` treats it as optional: past `run.max_restarts` the run goes on
without it, and it is stopped last, after the evaluator's final evaluation, which it
writes too.

What it reads, every `logging.interval_s` (a pass):
- the trainer's `metrics` stream (`Keys.metrics`, one `TrainMetrics` per step), from its
  start once, then the entries after the last one read;
- the run's counters, the `stats` hash (`streamrl.counters`);
- the evaluator's results, RUN_DIR/eval/step-N.json (`streamrl.evaluation.watch`).

What it writes. For each trainer step N that is new (x = N): `train_values` (the step's
loss, KL, entropy, gradient norm, policy age, examples/s, ...; the task's reward and solve
rate under `task/<label>/`; a mixture's under `task/all/` and each task's under its label),
with the run's counters and rates as the pass read them (`run_values`: totals and
per-minute rates of trajectories, groups, tool calls, and dropped groups by reason; a
mixture's tasks written, trajectories, groups emitted and dropped per task, `task_totals`;
the rates are over the time since the last pass that wrote a step, or since the worker
started). For each new evaluation at step N: `eval_values` at x = N. Then every sink is
flushed. Names (TensorBoard tags, W&B keys):

    train/loss train/kl train/entropy train/grad_norm train/clip_fraction
    train/policy_age_mean train/policy_age_max train/examples_per_s train/tokens_per_s
    train/examples train/groups train/tokens train/step_time_s train/policy_version
    train/mismatch_kl train/mismatch_kl_seq train/mismatch_logp_abs
    train/correction_fraction
    task/<task>/reward task/<task>/solve_rate
    task/<t>/groups_in_step task/<t>/tasks_total task/<t>/trajectories_total
    task/<t>/groups_total task/<t>/groups_dropped_total (and each _per_min)
                                          a mixture's, per task label t; <task> is
                                          then `all` (the whole step's)
    run/<c>_total run/<c>_per_min         c: trajectories, groups, tool_calls
    drops/<r>_total drops/<r>_per_min     r: all, stale, stale_at_trainer,
                                             too_few_valid, nonfinite, zero_variance, other
    eval/<task>/solve_rate eval/<task>/solve_rate_lo eval/<task>/solve_rate_hi
    eval/<task>/reward eval/<task>/error_rate eval/<task>/truncation_rate
                                          a mixture's: <task> `all` (pooled), and each
                                          task's label (its held-out split alone)

`drops/other` is what no reason counter names (timeouts: `grouper.group_timeout_policy`
drop, or a re-run past `max_reruns`); `drops/zero_variance` is 0 unless
`grouper.zero_variance = "drop"`. In TensorBoard the x axis is each event's step. In W&B
each trainer step and each evaluation is a row of its own whose x axis is a field of it:
`trainer/step` for the step's names, `eval/step` for the evaluation's (`define_metric`), so
an evaluation that comes after later trainer steps is still plotted at its own step.

Files (`streamrl.obs.sink_backends`; RunPaths.TENSORBOARD, RunPaths.WANDB):

    RUN_DIR/tensorboard/events.out.tfevents.<time>.<host>.<n>.<pid>   one per process;
                                     TensorBoard reads the directory as one run
    RUN_DIR/wandb/offline-run-<time>-<id>-<n>/run-<id>.wandb      one per sinks process,
                                     all with the run's one W&B id
    RUN_DIR/wandb/streamrl.json      that id
    RUN_DIR/wandb/{debug.log,...}, RUN_DIR/wandb/.home/  W&B's own logs and its config,
                                     cache, data and artifact directories (nothing in $HOME)

W&B runs offline by default (`logging.wandb_mode`): nothing goes to the network; upload
with `wandb sync RUN_DIR/wandb/offline-run-*` (the resumed parts of one run, in order).

Resume, restarts. A sink's progress (the last trainer step and evaluation step it wrote)
is read back from its own files when it opens (`Progress`): what the files hold is what was
written, whatever killed the writer before (a SIGKILLed W&B writer loses what its core
process had not written yet; those steps are written again). Steps and evaluations at or
below the progress are skipped, so a resumed or restarted run continues the same
TensorBoard directory and the same W&B run id with no step twice, and every step trained
after it is written: no gap. A step trained again after a trainer restart (the steps after
its checkpoint) keeps the figures first written for it.

Failures. A sink that fails (its package missing, a full disk, a W&B error) is logged once
(`sink_failed`, with the sink, the stage and the reason) and disabled for the life of the
process; the others and the run go on (`Guarded`).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import redis
import structlog

from streamrl import counters as c
from streamrl.config import Config
from streamrl.evaluation import watch as evalrun
from streamrl.jsontypes import integer, json_object, number
from streamrl.names import Keys
from streamrl.run.liveness import Liveness
from streamrl.run.summary import Stats, read_stats
from streamrl.transport import xrange_entries
from streamrl.wire import TrainMetrics, WireError, decode

# -- names -----------------------------------------------------------------------------------

TRAIN = "train/"
TASK = "task/"
EVAL = "eval/"
RUN = "run/"
DROPS = "drops/"
STEP_PREFIXES = (TRAIN, TASK, RUN, DROPS)  # the names written at each trainer step
TRAINER_STEP = "trainer/step"  # W&B: the x axis of those (TensorBoard: the event's step)
EVAL_STEP = "eval/step"  # W&B: an evaluation's x axis

# TrainMetrics field -> its name in the sinks.
TRAIN_FIELDS = {
    "loss": "train/loss",
    "kl": "train/kl",
    "entropy": "train/entropy",
    "grad_norm": "train/grad_norm",
    "clip_fraction": "train/clip_fraction",
    "policy_age_mean": "train/policy_age_mean",
    "max_policy_lag": "train/policy_age_max",
    "num_sequences": "train/examples",
    "num_groups": "train/groups",
    "num_tokens": "train/tokens",
    "step_time_s": "train/step_time_s",
    "version": "train/policy_version",
    "mismatch_kl": "train/mismatch_kl",
    "mismatch_kl_seq": "train/mismatch_kl_seq",
    "mismatch_logp_abs": "train/mismatch_logp_abs",
    "correction_fraction": "train/correction_fraction",
}
EXAMPLES_PER_S = "train/examples_per_s"  # the step's sequences over its time
TOKENS_PER_S = "train/tokens_per_s"

# The run's counters written as totals and per-minute rates: name -> stats fields summed.
RUN_COUNTERS = {
    "run/trajectories": (c.TRAJECTORIES,),
    "run/groups": (c.GROUPS,),
    "run/tool_calls": (c.TOOL_CALLS,),
}
# Dropped groups by reason (`drops/other`: the rest of `groups_dropped`).
DROP_REASONS = {
    "drops/stale": c.GROUPS_STALE,
    "drops/stale_at_trainer": c.TRAINER_GROUPS_STALE,
    "drops/too_few_valid": c.GROUPS_TOO_FEW_VALID,
    "drops/nonfinite": c.GROUPS_NONFINITE,
    "drops/zero_variance": c.GROUPS_ZERO_VARIANCE,
}
DROPS_ALL = "drops/all"
DROPS_OTHER = "drops/other"
TOTAL, PER_MIN = "_total", "_per_min"
MIXTURE = "all"  # a mixture's whole-run reward and eval go under task/all/, eval/all/


def tag_part(name: str) -> str:
    """`name` (a task's: `arithmetic`, `pkg.mod:Task`) as one part of a metric name:
    characters other than letters, digits, `_`, `.` and `-` become `_`."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "_"


# -- the pure part: records to values ----------------------------------------------------------


def train_values(m: TrainMetrics, task: str, per_task: bool = False) -> dict[str, float]:
    """One trainer step's figures by name (see the module docstring); `task`: the name
    its reward and solve rate go under; `per_task` (a mixture): each task's too, under
    its label (`TrainMetrics.tasks`), with its groups in the step."""
    out = {name: float(getattr(m, f)) for f, name in TRAIN_FIELDS.items()}
    per_s = 1.0 / m.step_time_s if m.step_time_s > 0 else 0.0
    out[EXAMPLES_PER_S] = m.num_sequences * per_s
    out[TOKENS_PER_S] = m.num_tokens * per_s
    out[f"{TASK}{tag_part(task)}/reward"] = float(m.reward_mean)
    out[f"{TASK}{tag_part(task)}/solve_rate"] = float(m.solve_rate)
    if per_task:
        for label, f in m.tasks.items():
            prefix = f"{TASK}{tag_part(label)}/"
            out[prefix + "reward"] = float(f.reward_mean)
            out[prefix + "solve_rate"] = float(f.solve_rate)
            out[prefix + "groups_in_step"] = float(f.groups)
    return out


def task_totals(stats: Stats) -> dict[str, float]:
    """A mixture's counters per task (`counters.PER_TASK`), as `task/<label>/<counter>`
    totals."""
    out: dict[str, float] = {}
    for label, counts in c.by_task(stats).items():
        for name, v in counts.items():
            out[f"{TASK}{tag_part(label)}/{name}"] = float(v)
    return out


def run_totals(stats: Stats, zero_variance_drops: bool) -> dict[str, float]:
    """The run's counters by name, totals (without the `_total` suffix): trajectories,
    groups, tool calls and dropped groups by reason. `zero_variance_drops`: the grouper
    drops zero-variance groups (`grouper.zero_variance = "drop"`); else its counter counts
    groups it kept, which are no drops."""

    def field(name: str) -> float:
        return float(stats.get(name, 0))

    out = {name: sum(field(f) for f in fields) for name, fields in RUN_COUNTERS.items()}
    reasons = {name: field(f) for name, f in DROP_REASONS.items()}
    if not zero_variance_drops:
        reasons["drops/zero_variance"] = 0.0
    dropped = field(c.GROUPS_DROPPED)
    out[DROPS_ALL] = dropped
    out.update(reasons)
    out[DROPS_OTHER] = max(0.0, dropped - sum(reasons.values()))
    return out


class Rates:
    """Per-minute rates of the totals between two passes that wrote a step: the first
    from the baseline taken at the start."""

    def __init__(self, now: float, totals: Mapping[str, float]) -> None:
        self._at = now
        self._totals = dict(totals)

    def update(self, now: float, totals: Mapping[str, float]) -> dict[str, float]:
        span = now - self._at
        out = {
            name: (value - self._totals.get(name, 0.0)) / span * 60.0 if span > 0 else 0.0
            for name, value in totals.items()
        }
        self._at, self._totals = now, dict(totals)
        return out


def run_values(totals: Mapping[str, float], rates: Mapping[str, float]) -> dict[str, float]:
    """The run's counters as written: `<name>_total` and `<name>_per_min`."""
    return {
        **{f"{name}{TOTAL}": v for name, v in totals.items()},
        **{f"{name}{PER_MIN}": v for name, v in rates.items()},
    }


def eval_values(result: Mapping[str, object], task: str) -> dict[str, float]:
    """One held-out evaluation's figures by name (a `streamrl eval --json` result): its
    greedy solve rate with its 95 % interval, mean reward, error and truncation rates."""
    greedy = json_object(result.get("greedy") or {})
    prefix = f"{EVAL}{tag_part(task)}/"
    out = {f"{prefix}solve_rate": number(result["solve_rate"])}
    solve = json_object(greedy.get("solve_rate") or {})
    for key, name in (("lo", "solve_rate_lo"), ("hi", "solve_rate_hi")):
        if key in solve:
            out[prefix + name] = number(solve[key])
    for key, name in (
        ("reward_mean", "reward"),
        ("error_rate", "error_rate"),
        ("truncation_rate", "truncation_rate"),
    ):
        figure = greedy.get(key)
        if isinstance(figure, Mapping) and "value" in figure:
            out[prefix + name] = number(figure["value"])
    return {k: v for k, v in out.items() if math.isfinite(v)}


# -- sinks -------------------------------------------------------------------------------------


@dataclass
class Progress:
    """What a sink has written: the last trainer step and the last evaluation's step (-1:
    none), as read back from its files when it opens."""

    step: int = -1
    eval_step: int = -1


class Sink(Protocol):
    """One destination (`streamrl.obs.sink_backends`). Each method may raise: `Guarded`
    disables the sink at its first failure."""

    name: str

    def open(self) -> Progress:
        """Start writing (continuing its files); what they hold already."""
        ...

    def write_step(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        """A trainer step's values at x = `step`; steps come in increasing order."""
        ...

    def write_eval(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        """An evaluation's values at x = `step` (may be below the last trainer step)."""
        ...

    def flush(self) -> None:
        """Hand what was written to the files."""
        ...

    def close(self) -> None: ...


@dataclass
class Guarded:
    """A sink as the exporter uses it: steps and evaluations it holds already skipped, and
    its first failure logged once (`sink_failed`) and the sink disabled for good."""

    sink: Sink
    log: structlog.stdlib.BoundLogger
    progress: Progress = field(default_factory=Progress)
    alive: bool = True
    written: int = 0  # trainer steps this process wrote
    skipped: int = 0  # trainer steps it found written already

    @property
    def name(self) -> str:
        return self.sink.name

    def open(self) -> None:
        try:
            self.progress = self.sink.open()
        except Exception as err:  # any failure of a sink: it must never stop the run
            self._failed("open", err)
            return
        p = self.progress
        self.log.info("sink_open", sink=self.name, step=p.step, eval_step=p.eval_step)

    def step(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        if not self.alive:
            return
        if step <= self.progress.step:
            self.skipped += 1
            return
        try:
            self.sink.write_step(step, values, wall_time)
        except Exception as err:
            self._failed("write", err)
            return
        self.progress.step = step
        self.written += 1

    def evaluation(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        if not self.alive or step <= self.progress.eval_step:
            return
        try:
            self.sink.write_eval(step, values, wall_time)
        except Exception as err:
            self._failed("write", err)
            return
        self.progress.eval_step = step

    def flush(self) -> None:
        if not self.alive:
            return
        try:
            self.sink.flush()
        except Exception as err:
            self._failed("flush", err)

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        try:
            self.sink.close()
        except Exception as err:
            self._failed("close", err)
            return
        self.log.info(
            "sink_closed",
            sink=self.name,
            written=self.written,
            skipped=self.skipped,
            step=self.progress.step,
        )

    def _failed(self, stage: str, err: Exception) -> None:
        """The sink's one failure: logged with its reason, the sink disabled."""
        self.alive = False
        reason = f"{type(err).__name__}: {err}"
        self.log.error("sink_failed", sink=self.name, stage=stage, reason=reason)


# -- the exporter: the sinks worker's loop -----------------------------------------------------

PAGE = 500  # metrics entries read per XRANGE


class Exporter:
    """Reads the run's figures (module docstring) and writes the new ones to every sink,
    once per `logging.interval_s`; a last pass when stopped."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        cfg: Config,
        run_dir: Path,
        sinks: Sequence[Sink],
        log: structlog.stdlib.BoundLogger,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self.eval_root = evalrun.eval_dir(run_dir)
        self.sinks = [Guarded(s, log) for s in sinks]
        self.log = log
        self.clock = clock
        # what the whole run's reward goes under: its task's label, or a mixture's "all"
        self.task = cfg.mixture[0].label if len(cfg.mixture) == 1 else MIXTURE
        self.per_task = len(cfg.mixture) > 1
        self.cursor = "-"  # XRANGE start: the entry after the last one read
        self.unreadable = 0
        self.rates: Rates | None = None

    def open(self) -> None:
        for s in self.sinks:
            s.open()
        self.rates = Rates(self.clock(), self._totals())

    @property
    def alive(self) -> bool:
        return any(s.alive for s in self.sinks)

    def _totals(self) -> dict[str, float]:
        stats = read_stats(self.client, self.keys)
        out = run_totals(stats, self.cfg.grouper.zero_variance == "drop")
        if self.per_task:
            out.update(task_totals(stats))
        return out

    def new_metrics(self) -> list[TrainMetrics]:
        """The trainer's metrics entries after the last read, in stream order (a step
        trained again after a trainer restart comes again: the sinks skip it)."""
        out: list[TrainMetrics] = []
        while True:
            entries = xrange_entries(self.client, self.keys.metrics, self.cursor, count=PAGE)
            for entry_id, fields in entries:
                try:
                    out.append(decode(fields, TrainMetrics))
                except WireError as err:
                    self.unreadable += 1
                    self.log.warning("metrics_unreadable", entry_id=entry_id, error=str(err))
            if entries:
                self.cursor = "(" + entries[-1][0]
            if len(entries) < PAGE:
                return out

    def pass_once(self) -> int:
        """One pass: every new step and evaluation to every live sink, then flush. The
        number of new metrics entries read."""
        assert self.rates is not None, "open() first"
        records = self.new_metrics()
        if records:
            totals = self._totals()
            run = run_values(totals, self.rates.update(self.clock(), totals))
            for m in records:
                values = {**train_values(m, self.task, self.per_task), **run}
                for s in self.sinks:
                    s.step(m.step, values, m.created_at)
        done = min((s.progress.eval_step for s in self.sinks if s.alive), default=None)
        if done is not None:
            for result in evalrun.results_after(self.eval_root, done):
                values = eval_values(result, self.task)
                for label, part in evalrun.task_results(result).items():
                    values.update(eval_values(json_object(part), label))
                wall = number(result.get("written_at") or self.clock())
                for s in self.sinks:
                    s.evaluation(integer(result["step"]), values, wall)
        for s in self.sinks:
            s.flush()
        return len(records)

    def run(self, stop: threading.Event, liveness: Liveness, interval_s: float) -> None:
        """Passes until `stop`, then a last one (the run's final steps and evaluation),
        then close every sink. A Redis error skips the pass (the next one reads on)."""
        with liveness.busy(max_s=OPEN_MAX_S):
            self.open()
        try:
            while self.alive:
                stopping = stop.wait(interval_s)
                liveness.tick()
                try:
                    with liveness.busy(max_s=PASS_MAX_S):
                        self.pass_once()
                except redis.RedisError as err:
                    self.log.warning("sinks_pass_failed", error=f"{type(err).__name__}: {err}")
                if stopping:
                    break
            if not self.alive:
                # nothing left to write: idle, beating, until stopped (an exit would be
                # restarted as a crash, and the sinks fail again)
                self.log.error("sinks_all_failed")
                while not stop.wait(interval_s):
                    liveness.tick()
        finally:
            for s in self.sinks:
                s.close()


OPEN_MAX_S = 300.0  # opening a sink (W&B starts its core process; TensorBoard reads back)
PASS_MAX_S = 300.0  # one pass (a long backlog after a restart)
