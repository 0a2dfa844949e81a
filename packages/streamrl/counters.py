"""Every field of a run's stats hash (`Keys.stats`), declared once with who writes and reads it.

The stats hash holds the run's counters: what summary.json, `streamrl queues`, `streamrl
status`, the report and rollout's flow control read. Each field is a constant here (import it,
never type the string again), registered in `FIELDS` with its writer, its readers and whether
it is exact under retries. A test greps every HINCRBY target in the package's Python and Lua
against this module; the Lua scripts get the constants as a `C` table (`lua_prelude`).

"Exact" fields count each effect once, whatever retries, replays and restarts do: a Lua
script guards them (the grouper's emitted and dropped sets), or they are gauges set to a
value. "Approximate" ones count an event again when it happens again: a MULTI/EXEC retried
after a lost reply, a task replayed after its rollout worker died, a trainer restarted
before its checkpoint setting the same groups aside again.

Per-worker counters (rates, latencies, queue depths sampled by each process) are another
channel: `streamrl.obs.metrics`. The trainer's per-step metrics are a stream (`Keys.metrics`).

Light: imports nothing beyond the standard library and the wire's status set.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from streamrl.wire import Status

Kind = Literal["counter", "sum", "gauge"]


@dataclass(frozen=True)
class Field:
    """One stats-hash field: `kind` counter (HINCRBY), sum (HINCRBYFLOAT of seconds) or
    gauge (HSET of the latest value); `writer`: the module that writes it; `readers`: who
    reads it; `exact`: counted once under retries and replays (see the module doc)."""

    name: str
    kind: Kind
    writer: str
    readers: str
    exact: bool
    doc: str


_fields: dict[str, Field] = {}


def _field(name: str, kind: Kind, writer: str, readers: str, exact: bool, doc: str) -> str:
    if name in _fields:
        raise ValueError(f"stats field {name!r} declared twice")
    _fields[name] = Field(name, kind, writer, readers, exact, doc)
    return name


_SUMMARY = "launcher (summary.json, progress line)"

# -- feeder ------------------------------------------------------------------------------
TASKS = _field(
    "tasks", "counter", "feeder", "operators (queues --json)", False,
    "tasks the feeder wrote to `tasks` (with the cursor, in one MULTI/EXEC)",
)  # fmt: skip

# -- rollout -----------------------------------------------------------------------------
TRAJECTORIES = _field(
    "trajectories", "counter", "rollout.worker", f"{_SUMMARY}, status", False,
    "trajectories committed to `trajectories` (re-runs of missing members and the members "
    "of a task replayed after its worker died count again: these are writes)",
)  # fmt: skip


def episodes(status: Status) -> str:
    """The field counting episodes that ended with `status` (`EPISODES_OK`, ...)."""
    return f"episodes_{status}"


def _episodes(status: Status) -> str:
    doc = f"episodes that ended with status `{status}` (committed with their trajectory)"
    return _field(episodes(status), "counter", "rollout.worker", _SUMMARY, False, doc)


EPISODES_OK = _episodes("ok")
EPISODES_TIMEOUT = _episodes("timeout")
EPISODES_ERROR = _episodes("error")
EPISODES_TRUNCATED = _episodes("truncated")
TASKS_DONE = _field(
    "tasks_done", "counter", "rollout.worker", "operators (queues --json)", False,
    "feeder tasks whose every member this worker committed (the feeder's backlog is read "
    "from the stream, not from this count)",
)  # fmt: skip
RERUN_TASKS_DONE = _field(
    "rerun_tasks_done", "counter", "rollout.worker", "operators (queues --json)", False,
    "re-run tasks (a timed-out group's missing members) whose members were committed",
)  # fmt: skip
EPISODES_RESUMED = _field(
    "episodes_resumed", "counter", "rollout.worker", "operators (queues --json)", False,
    "episodes resumed from their last turn boundary after their worker died",
)  # fmt: skip
EPISODES_RESUMED_SAVED_S = _field(
    "episodes_resumed_saved_s", "sum", "rollout.worker", "operators (queues --json)", False,
    "seconds of sampling and tool time the resumed episodes did not redo",
)  # fmt: skip
ADMISSION_TRIMS = _field(
    "admission_trims", "counter", "rollout.worker", "status, operators (queues --json)", False,
    'times adaptive admission (rollout.max_concurrency = "auto") cut its limit below the '
    "episodes running, on an eviction, a full KV pool or its latency ceiling (a bigger "
    "decode batch that costs more per token)",
)  # fmt: skip
BACKPRESSURE_PAUSES = _field(
    "backpressure_pauses", "counter", "rollout.worker", "queues", False,
    "times a rollout worker entered a backpressure pause (each worker counts its own)",
)  # fmt: skip
TOOL_CALLS = _field(
    "tool_calls", "counter", "tools.client (rollout)", _SUMMARY, False,
    "tool calls answered (a call of a replayed episode counts again)",
)  # fmt: skip
TOOL_ERRORS = _field(
    "tool_errors", "counter", "tools.client (rollout)", _SUMMARY, False,
    "tool calls answered with an error the agent saw (the tool's own failure)",
)  # fmt: skip
TOOL_INFRA_ERRORS = _field(
    "tool_infra_errors", "counter", "tools.client (rollout)", _SUMMARY, False,
    "tool calls that failed in the infrastructure (no worker, sandbox down, timeout)",
)  # fmt: skip
TOOL_LEDGER_HITS = _field(
    "tool_ledger_hits", "counter", "tools.client and tools.ledger's AsyncToolLedger (rollout)",
    "operators (queues --json)", False,
    "non-idempotent tool calls answered from the ledger instead of running again (a tool "
    "worker marks the result `ledger_hit`, the rollout counts it: tool workers write no "
    "stats, review N18)",
)  # fmt: skip

# -- grouper (its Lua scripts) -------------------------------------------------------------
GROUPS = _field(
    "groups", "counter", "grouper", f"{_SUMMARY}, status, report, rollout backpressure", True,
    "groups written to `groups` (complete, or released after a timeout), each once",
)  # fmt: skip
GROUPS_DROPPED = _field(
    "groups_dropped", "counter", "grouper; trainer (stale)", f"{_SUMMARY}, queues, report, "
    "rollout sync batches", False,
    "groups dropped, each once: by a grouper's rule or timeout, or by the trainer as stale",
)  # fmt: skip
TRAJECTORIES_DROPPED = _field(
    "trajectories_dropped", "counter", "grouper", _SUMMARY, False,
    "members of dropped groups (held, or arriving after the drop)",
)  # fmt: skip
GROUPS_TIMED_OUT = _field(
    "groups_timed_out", "counter", "grouper", "queues", True,
    "incomplete groups past grouper.group_timeout_s, each time the policy acted",
)  # fmt: skip
GROUPS_RERUN = _field(
    "groups_rerun", "counter", "grouper", "queues", True,
    "re-run tasks written for timed-out groups' missing members",
)  # fmt: skip
GROUPS_RELEASED = _field(
    "groups_released", "counter", "grouper", "queues", True,
    "timed-out groups emitted with the members they had (policy release)",
)  # fmt: skip
GROUPS_ZERO_VARIANCE = _field(
    "groups_zero_variance", "counter", "grouper", "operators (queues --json)", True,
    "groups whose valid rewards were all equal (dropped or emitted, per grouper.zero_variance)",
)  # fmt: skip
GROUPS_TOO_FEW_VALID = _field(
    "groups_too_few_valid", "counter", "grouper", "operators (queues --json)", True,
    "groups dropped with fewer valid members than grouper.min_valid_members",
)  # fmt: skip
GROUPS_STALE = _field(
    "groups_stale", "counter", "grouper", "sinks worker (streamrl.obs.sinks)", True,
    "groups dropped by a grouper because a member was too far off policy "
    "(grouper.off_policy_steps; the trainer's own are trainer_groups_stale)",
)  # fmt: skip
GROUPS_NONFINITE = _field(
    "groups_nonfinite", "counter", "grouper", "operators (queues --json)", True,
    "groups dropped for a reward or an advantage that is not finite",
)  # fmt: skip
GROUPS_ORDER_HELD = _field(
    "groups_order_held", "counter", "grouper", "operators (queues --json)", True,
    "grouper.order submission: groups held until every earlier task's group was written "
    "or dropped",
)  # fmt: skip
GROUPS_ORDER_SKIPPED = _field(
    "groups_order_skipped", "counter", "grouper", "operators (queues --json)", True,
    "grouper.order submission: task cursors no longer waited for (order_window or "
    "order_max_wait_s reached); their groups, if they come, are written out of order",
)  # fmt: skip
GROUPS_OUT_OF_ORDER = _field(
    "groups_out_of_order", "counter", "grouper", "operators (queues --json)", True,
    "grouper.order submission: groups written after their cursor was skipped",
)  # fmt: skip
MAX_TRAJECTORY_POLICY_VERSION = _field(
    "max_trajectory_policy_version", "gauge", "grouper", _SUMMARY, True,
    "the newest policy version any trajectory added to a group was sampled with",
)  # fmt: skip

# -- any consumer (transport) --------------------------------------------------------------
DEAD_LETTERS = _field(
    "dead_letters", "counter", "transport (every consumer)", "operators (queues --json)", False,
    "entries moved to the dead letters (with their entry's acknowledgement)",
)  # fmt: skip

# -- trainer -------------------------------------------------------------------------------
TRAINER_STEPS = _field(
    "trainer_steps", "gauge", "trainer.loop", f"{_SUMMARY}, status", True,
    "the trainer's last step (with its metrics entry)",
)  # fmt: skip
GROUPS_TRAINED = _field(
    "groups_trained", "gauge", "trainer.loop", f"{_SUMMARY}, report, rollout backpressure",
    True, "groups trained in the trainer's lineage (restored with its checkpoint)",
)  # fmt: skip
GROUPS_SET_ASIDE = _field(
    "groups_set_aside", "counter", "trainer.loop", "rollout backpressure and sync batches",
    False, "groups the trainer took without training (dead-lettered or dropped as stale): "
    "no longer waiting for it, like the trained ones",
)  # fmt: skip
TRAINER_GROUPS_STALE = _field(
    "trainer_groups_stale", "counter", "trainer.loop", "rollout sync batches", False,
    "groups the trainer dropped as too far off policy (also in groups_dropped)",
)  # fmt: skip
TRAINER_ROWS_MASKED = _field(
    "trainer_rows_masked", "counter", "trainer.loop", "operators (queues --json)", False,
    "rows trained without their (missing) rollout log-probabilities",
)  # fmt: skip
TRAINER_NONFINITE_STEPS = _field(
    "trainer_nonfinite_steps", "counter", "trainer.loop", "operators (queues --json)", False,
    "steps skipped because the loss, gradient or update was not finite",
)  # fmt: skip
POLICY_VERSION = _field(
    "policy_version", "gauge", "trainer.publish", f"{_SUMMARY}, report", True,
    "the last policy version published (with its `weights` entry)",
)  # fmt: skip

FIELDS: MappingProxyType[str, Field] = MappingProxyType(_fields)
"""Every stats-hash field by name."""

# -- per task (a mixture's, issue 32) ------------------------------------------------------
# In a mixture ([[tasks]]) these fields are also counted per task, as `task/<label>/<field>`
# beside the whole run's, by the same writer and no more exactly than it: the feeder's tasks
# in its transaction (exact), rollout's trajectories with its own (approximate), the
# grouper's groups emitted and dropped after its scripts answered, not in them (approximate).
PER_TASK = (TASKS, TRAJECTORIES, GROUPS, GROUPS_DROPPED)
_TASK_PREFIX = "task/"


def per_task(label: str, field: str) -> str:
    """The stats field that counts `field` (one of PER_TASK) for the task `label`."""
    if field not in PER_TASK:
        raise KeyError(f"{field!r} is not counted per task (counters.PER_TASK)")
    return f"{_TASK_PREFIX}{label}/{field}"


def split_per_task(name: str) -> tuple[str, str] | None:
    """(label, field) of a per-task field's name, else None."""
    if not name.startswith(_TASK_PREFIX):
        return None
    label, _, field = name[len(_TASK_PREFIX) :].rpartition("/")
    return (label, field) if label and field in PER_TASK else None


def by_task(stats: Mapping[str, object]) -> dict[str, dict[str, int]]:
    """The per-task counters of a stats hash, {label: {field: value}}."""
    out: dict[str, dict[str, int]] = {}
    for name, value in stats.items():
        split = split_per_task(name)
        if split is not None:
            out.setdefault(split[0], {})[split[1]] = int(float(str(value)))
    return out


# The group policies' counters that `streamrl queues` shows in its table.
POLICY_COUNTERS = (
    GROUPS_TIMED_OUT,
    GROUPS_DROPPED,
    GROUPS_RERUN,
    GROUPS_RELEASED,
    BACKPRESSURE_PAUSES,
)


def constants() -> dict[str, str]:
    """Each field's constant name -> its field name (`GROUPS` -> "groups")."""
    return {
        k: v for k, v in globals().items() if k.isupper() and isinstance(v, str) and v in FIELDS
    }


def lua_prelude(script: str) -> str:
    """The Lua line that gives `script` the fields it names as `C.NAME` in a table `C`, to be
    prepended to it, so no field name is typed again in Lua. A name that is no field raises
    KeyError (at load, not when the script runs)."""
    known = constants()
    used = sorted(set(re.findall(r"\bC\.([A-Z_]+)\b", script)))
    missing = [name for name in used if name not in known]
    if missing:
        raise KeyError(f"no stats field {', '.join(missing)} (streamrl.counters)")
    if not used:
        return ""
    return "local C = {" + ", ".join(f"{k} = '{known[k]}'" for k in used) + "}\n"
