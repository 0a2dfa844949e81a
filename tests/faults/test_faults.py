"""Fault injection: kill anything, lose nothing, repeat nothing.

One `streamrl up` run of at least MIN_STEPS trainer steps. While it runs, every worker type
(feeder, rollout, tools, grouper, trainer) is SIGKILLed, the embedded Redis twice (AOF
everysec), the launcher once (the run is then continued with `streamrl up --resume`, which
stops the dead launcher's orphans first), and one worker is SIGSTOPped for longer than the
liveness limit (the launcher must find it hung and restart it), at moments drawn from a
fixed seed; one trainer kill lands mid checkpoint write (after the state, before the commit
marker), one mid weight publish, one rollout kill mid weight load and one mid episode,
right after episode states that hold a finished tool call were written (failpoints,
`streamrl.run.failpoints`). The calculator is a non-idempotent tool here, so every call of it
goes through the tool ledger. The run is then stopped and its final state read back, from
ids:

- every task the feeder issued is trained exactly once in the final lineage, dropped by a
  logged policy, or still queued (in flight: it would be trained on resume); none is lost;
- no group appears twice in the lineage, whose steps run 1..N without a gap, and each
  trainer restart continued at the step after the checkpoint it restored;
- no tool side effect ran twice (each ledger key executed once, infrastructure errors aside);
- episodes were resumed from a turn boundary (counted, with the sampling and tool time they
  saved), and recovery did not favour short episodes (mean length of the trained groups'
  trajectories against every trajectory committed);
- the cut-off checkpoint was ignored with a logged reason;
- no process and no sandbox container of the run is left.

It prints the faults injected, groups trained, lost and duplicated, tool side effects run
twice, episodes resumed, the bias check and the recovery time (kill to the next useful work
of that part) per fault.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from streamrl import checkpoints as ckpts
from streamrl.config import load_config
from streamrl.names import Keys
from streamrl.run import failpoints as fp
from streamrl.run.redis_server import EmbeddedRedis
from streamrl.tasks.registry import make_task
from streamrl.wire import Group, Task, Trajectory, WireError, decode
from tests.e2e.test_up import up_command
from tests.helpers import NO_EVALUATOR, REPO, TINY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

SEED = 20261130
MIN_STEPS = 30
FAILPOINT_PAUSE_S = 6.0
# (part, failpoint or None for a random moment)
LIVENESS_S = 15.0
# (part, failpoint or None for a random moment). "stop": the trainer SIGSTOPped until the
# launcher finds it hung; "launcher": the launcher SIGKILLed and the run resumed.
FAULTS: list[tuple[str, str | None]] = [
    ("trainer", fp.CHECKPOINT_COMMIT),
    ("trainer", fp.WEIGHTS_PUBLISH),
    ("trainer", None),
    ("rollout", fp.WEIGHTS_LOAD),
    ("rollout", fp.EPISODE_SAVED),
    ("grouper", None),
    ("grouper", None),
    ("tools", None),
    ("tools", None),
    ("feeder", None),
    ("redis", None),
    ("redis", None),
    ("stop", None),
    ("launcher", None),
]
# The event that shows a part doing useful work again after its kill.
RECOVERED_BY = {
    "trainer": ("trainer-0", "train_step"),
    "rollout": ("rollout-0", "trajectories_committed"),
    "grouper": ("grouper-0", "group_emitted"),
    "redis": ("grouper-0", "group_emitted"),  # trajectories flow through Redis again
    "feeder": ("feeder-0", "feeder_start"),
    "stop": ("trainer-0", "train_step"),
    "launcher": ("trainer-0", "train_step"),
}


class Logs:
    """The run's JSON log events, read as they are written."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._offsets: dict[str, int] = {}
        self.events: dict[str, list[dict[str, Any]]] = {}

    def poll(self) -> None:
        for path in sorted(self.root.glob("*.log")):
            name = path.stem
            with open(path, "rb") as f:
                f.seek(self._offsets.get(name, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[name] = self._offsets.get(name, 0) + end
            for line in data[:end].splitlines():
                if line.startswith(b"{"):
                    e = json.loads(line)
                    e["t"] = datetime.fromisoformat(e["timestamp"]).timestamp()
                    self.events.setdefault(name, []).append(e)

    def find(self, worker: str, event: str, after: float = 0.0) -> list[dict[str, Any]]:
        self.poll()
        return [e for e in self.events.get(worker, []) if e["event"] == event and e["t"] > after]

    def pid(self, worker: str) -> int:
        """The worker's current pid, from the launcher's log."""
        pid = 0
        self.poll()
        for e in self.events.get("launcher", []):  # in order: a --resume starts them anew
            if e["event"] == "workers_started":
                pid = e["pids"].get(worker, pid)
            elif e["event"] == "worker_restarted" and e["worker"] == worker:
                pid = e["pid"]
        assert pid, f"no pid for {worker}"
        return pid


def trainer_steps(logs: Logs) -> int:
    steps = logs.find("trainer-0", "train_step")
    return int(steps[-1]["step"]) if steps else 0


class Up:
    """The run's current `streamrl up` process: the first, then the `--resume` that
    continues it after the launcher was killed. Its output goes to `up.out`."""

    def __init__(self, tmp_path: Path, sets: list[str], env: dict[str, str]) -> None:
        self.run_dir = tmp_path / "run"
        self.sets = sets
        self.env = env
        self.out = open(tmp_path / "up.out", "ab")  # noqa: SIM115 (closed in stop())
        self.launches = 0
        self.proc = self._start(["--run-dir", str(self.run_dir)])

    def _start(self, where: list[str]) -> subprocess.Popen[bytes]:
        cmd = up_command(TINY, 0, *where, sets=(NO_EVALUATOR, *self.sets))
        self.launches += 1
        return subprocess.Popen(
            cmd, cwd=REPO, env=self.env, stdout=self.out, stderr=subprocess.STDOUT
        )

    def resume(self) -> None:
        self.proc = self._start(["--resume", str(self.run_dir)])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=180)
        self.out.close()
        return code


def wait_for(what: str, cond: Any, up: Up, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert up.proc.poll() is None, f"the run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def run_processes(run_dir: Path) -> list[int]:
    """Live processes whose command line names the run directory (workers, Redis)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(run_dir).encode() in cmd and state != "Z":
            out.append(int(d))
    return out


def sandbox_containers(ns: str) -> list[str] | None:
    """Containers labelled with the run's namespace; None when no engine is reachable."""
    if not os.environ.get("DOCKER_HOST"):
        return None
    import docker

    try:
        client = docker.from_env()
        found = client.containers.list(all=True, filters={"label": f"streamrl.sandbox={ns}"})
    except docker.errors.DockerException:
        return None
    return [str(c.name) for c in found]


def queued_group_ids(client: redis.Redis, keys: Keys) -> set[str]:
    """Group ids of work still queued at the end: tasks, trajectories and groups not yet
    acknowledged by their consumer, and groups being assembled."""
    snap = ckpts.take_snapshot(client, keys)
    out = set(snap.partial_groups)
    kinds: dict[str, Any] = {keys.tasks: Task, keys.trajectories: Trajectory, keys.groups: Group}
    for s in snap.streams:
        for _eid, flat in s.entries:
            fields = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
            try:
                out.add(decode(fields, kinds[s.stream]).group_id)
            except WireError:
                continue
    return out


SETS = [
    "run.max_restarts=50",
    "run.restart_backoff_s=0.2",
    f"run.liveness_timeout_s={LIVENESS_S}",
    "trainer.groups_per_step=2",
    "trainer.checkpoint_every=3",
    "trainer.publish_every=1",
    "transport.claim_idle_ms=1500",
    "transport.claim_every_ms=300",
    "tools.result_margin_s=2",
    'tools.non_idempotent=["calculator"]',
    "rollout.max_ready_groups=4",
]


def run_with_faults(
    tmp_path: Path, sets: list[str], rng: random.Random
) -> tuple[list[dict[str, Any]], Logs]:
    """`streamrl up` with the faults injected in a seeded order; stopped (SIGINT) once
    MIN_STEPS are trained after the last fault."""
    fp_dir = tmp_path / "failpoints"
    fp_dir.mkdir()
    env = {**os.environ, fp.ENV: str(fp_dir), "PYTHONUNBUFFERED": "1"}
    up = Up(tmp_path, sets, env)
    logs = Logs(up.run_dir / "logs")
    plan = FAULTS[:]
    rng.shuffle(plan)
    injected: list[dict[str, Any]] = []
    try:
        wait_for("the first trainer step", lambda: trainer_steps(logs) >= 1, up, 600)
        for part, point in plan:
            time.sleep(rng.uniform(0.5, 4.0))
            injected.append(inject(part, point, rng, logs, up, fp_dir))
        wait_for(f"{MIN_STEPS} steps", lambda: trainer_steps(logs) >= MIN_STEPS, up, 900)
    finally:
        code = up.stop()
    assert code == 0, (tmp_path / "up.out").read_text()
    logs.poll()
    return injected, logs


def check_restarts(logs: Logs) -> None:
    """Each trainer restart went on from the step of the checkpoint it restored, and the
    checkpoint cut off before its commit marker was ignored with the reason."""
    events = logs.events["trainer-0"]
    resumes = 0
    for i, e in enumerate(events):
        if e["event"] == "trainer_resumed":
            resumes += 1
            after = [x for x in events[i + 1 :] if x["event"] == "train_step"]
            assert not after or after[0]["step"] == e["step"] + 1, (e, after[:1])
    assert resumes >= 3
    removed = [e for e in events if e["event"] == "checkpoint_removed"]
    assert any("commit marker" in e["reason"] for e in removed), removed


def final_redis_state(run_dir: Path, keys: Keys) -> tuple[int, set[str], set[str], dict[str, str]]:
    """(feeder cursor, dropped group ids, group ids still queued, stats), from the run's
    AOF."""
    with EmbeddedRedis(run_dir / "redis") as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        cursor = int(client.get(keys.feeder_cursor) or 0)
        raw: Any = client.smembers(keys.groups_dropped)
        stats: Any = client.hgetall(keys.stats)
        client.close()
        queued = queued_group_ids(redis.Redis.from_url(server.url), keys)
    return cursor, set(raw), queued, stats


def side_effects_twice(logs: Logs) -> dict[str, int]:
    """Ledger keys whose tool ran more than once (executions under a claim that were not an
    infrastructure error), from every worker's `tool_ledger_ran` lines."""
    runs: dict[str, int] = {}
    for es in logs.events.values():
        for e in es:
            if e["event"] == "tool_ledger_ran" and not e["infra"]:
                runs[e["key"]] = runs.get(e["key"], 0) + 1
    assert runs, "no tool call went through the ledger"
    return {k: n for k, n in runs.items() if n > 1}


def length_bias(logs: Logs, trained: set[str]) -> dict[str, float]:
    """Mean tokens and tool calls per trajectory: of the groups trained, and of every
    trajectory committed (each once, its last commit). Recovery that lost or dropped long
    episodes more than short ones would make the first smaller."""
    last: dict[str, dict[str, Any]] = {}
    for name, es in logs.events.items():
        if name.startswith("rollout"):
            for e in es:
                if e["event"] == "trajectories_committed":
                    last.update((t["traj_id"], t) for t in e["trajectories"])
    every = list(last.values())
    ours = [t for t in every if t["traj_id"].rsplit("-", 1)[0] in trained]
    assert ours, "no trained trajectory in the rollout logs"
    return {
        "tokens_trained": round(statistics.mean(t["tokens"] for t in ours), 2),
        "tokens_all": round(statistics.mean(t["tokens"] for t in every), 2),
        "tool_calls_trained": round(statistics.mean(t["tool_calls"] for t in ours), 3),
        "tool_calls_all": round(statistics.mean(t["tool_calls"] for t in every), 3),
    }


def restarts(logs: Logs) -> dict[str, int]:
    """Worker and Redis restarts of both launchers, from the launcher's log."""
    out: dict[str, int] = {}
    for e in logs.events["launcher"]:
        if e["event"] == "worker_restarted":
            out[e["worker"]] = out.get(e["worker"], 0) + 1
        elif e["event"] == "redis_crashed":
            out["redis"] = out.get("redis", 0) + 1
    return out


def test_kill_anything_lose_nothing_repeat_nothing(tmp_path: Path, warm_cache: str) -> None:
    ns = f"faults{os.getpid()}"
    sets = [f'model.cache_dir="{warm_cache}"', f"run.name={ns}", *SETS]
    run_dir = tmp_path / "run"
    injected, logs = run_with_faults(tmp_path, sets, random.Random(SEED))

    # Nothing left behind: no process of the run, no sandbox container.
    assert run_processes(run_dir) == []
    assert sandbox_containers(ns) in (None, [])

    # The history: the last train_step line of each step (a trainer restart trains the
    # steps after its checkpoint again); steps 1..N, no group twice, and the checkpoint's
    # lineage (a window of it) agrees; restarts continued without a gap.
    final = ckpts.latest_complete(run_dir / "checkpoints")
    assert final is not None and final.step >= MIN_STEPS
    history: dict[int, list[str]] = {}
    for e in logs.events["trainer-0"]:
        if e["event"] == "train_step":
            history[int(e["step"])] = list(e["group_ids"])
    assert sorted(history)[: final.step] == list(range(1, final.step + 1))
    for step, ids in final.meta()["lineage"]:
        assert history[step] == ids, step
    trained_list = [g for s in range(1, final.step + 1) for g in history[s]]
    trained = set(trained_list)
    check_restarts(logs)

    # From ids: every task issued is trained once, dropped by a logged policy, or queued.
    cfg = load_config(TINY, overrides=sets)
    cursor, dropped, queued, stats = final_redis_state(run_dir, Keys(ns))
    issued = {
        make_task(cfg.task, cfg.run.seed, c, cfg.rollout.num_generations).group_id
        for c in range(cursor)
    }
    drop_reasons = {
        e["group_id"]: str(e["reason"])
        for name, es in logs.events.items()
        if name.startswith(("grouper", "trainer"))
        for e in es
        if e["event"] == "group_dropped" and e.get("reason")
    }
    logged_drops = set(drop_reasons)
    stale = {g for g, reason in drop_reasons.items() if "stale" in reason}
    # Issue 30 (review N1): a restart judged the groups it trains again (trained once by a
    # trainer whose state the restart discarded) against a version that jumped at resume,
    # and about 40 % of them were dropped as stale. (Groups that are stale in the run's
    # ordinary course, off_policy_steps 2 here, are dropped in any run; counted apart.)
    steps = [e for e in logs.events["trainer-0"] if e["event"] == "train_step"]
    last_of_step = {int(e["step"]): i for i, e in enumerate(steps)}
    rewound = {  # trained by a trainer whose state a restart discarded
        g for i, e in enumerate(steps) if last_of_step[int(e["step"])] != i for g in e["group_ids"]
    }
    rewound_stale = stale & rewound
    assert dropped <= logged_drops, dropped - logged_drops
    # Redis keeps only a window of the dropped ids (README, "Bounded state"); the log has all.
    dropped = logged_drops
    assert not trained & dropped
    assert trained <= issued
    lost = issued - trained - dropped - queued

    recovery: dict[str, list[float]] = {}
    for f in injected:
        recovery.setdefault(f["part"], []).append(f["recovery_s"])
    twice = side_effects_twice(logs)
    bias = length_bias(logs, trained)
    report: dict[str, Any] = {
        "faults_injected": len(injected),
        "faults": [
            {k: f[k] for k in ("part", "point", "step", "recovery_s", "detected_s") if k in f}
            for f in injected
        ],
        "trainer_steps": final.step,
        "tasks_issued": len(issued),
        "groups_trained": len(trained),
        "groups_dropped": len(dropped),
        "groups_dropped_stale": len(stale),
        "groups_rewound": len(rewound),
        "rewound_groups_dropped_stale": len(rewound_stale),
        "groups_queued_at_stop": len(queued - trained - dropped),
        "groups_lost": len(lost),
        "groups_duplicated": len(trained_list) - len(trained),
        "tool_side_effects_run_twice": len(twice),
        "episodes_resumed": int(stats.get("episodes_resumed", 0)),
        "episodes_resumed_saved_s": round(float(stats.get("episodes_resumed_saved_s", 0)), 2),
        "length_bias": bias,
        "median_recovery_s": {p: round(statistics.median(v), 2) for p, v in recovery.items()},
        "restarts": restarts(logs),
        "launches": 2,
    }
    (run_dir / "faults_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\nfault injection report\n" + json.dumps(report, indent=2))
    assert sorted(lost) == [], f"groups lost: {sorted(lost)[:10]}"
    assert report["groups_duplicated"] == 0
    assert report["rewound_groups_dropped_stale"] == 0, sorted(rewound_stale)[:10]
    assert twice == {}, f"tool side effects run twice: {twice}"
    assert report["episodes_resumed"] > 0
    # Recovery does not favour short episodes: trained trajectories are not shorter than
    # every committed one by more than noise.
    assert bias["tokens_trained"] >= 0.9 * bias["tokens_all"], bias
    n = report["restarts"]
    assert n.get("redis", 0) == 2, n
    for part in ("rollout", "grouper", "trainer"):
        assert n.get(f"{part}-0", 0) >= 2, n
    assert n.get("feeder-0", 0) >= 1, n
    assert sum(v for w, v in n.items() if w.startswith("tools")) >= 2, n


def inject(
    part: str,
    point: str | None,
    rng: random.Random,
    logs: Logs,
    up: Up,
    fp_dir: Path,
) -> dict[str, Any]:
    """SIGKILL one part (at a failpoint, or now), or SIGSTOP the trainer, and wait until it
    works again."""
    worker = {"tools": f"tools-{rng.randrange(2)}", "stop": "trainer-0"}.get(part, f"{part}-0")
    detected_s = None
    if point is not None:
        armed = time.time()
        fp.arm(fp_dir, point, FAILPOINT_PAUSE_S)
        hit = wait_for(
            f"failpoint {point}",
            lambda: [e for e in logs.find(worker, "failpoint", armed) if e["name"] == point],
            up,
            300,
        )
        pid = int(hit[0]["pid"])
    elif part == "redis":
        pid = int((up.run_dir / "redis" / "redis.pid").read_text())
    elif part == "launcher":
        pid = up.proc.pid
    else:
        pid = logs.pid(worker)
    killed = time.time()
    if part == "redis":
        os.kill(pid, signal.SIGKILL)
    elif part == "launcher":
        # Its workers and its Redis live on as orphans; --resume must stop them first.
        up.proc.kill()
        up.proc.wait()
        up.resume()
        wait_for("the orphans stopped", lambda: logs.find("launcher", "orphans_stopped"), up, 300)
    elif part == "stop":
        os.killpg(pid, signal.SIGSTOP)
        hung = wait_for(
            "the stopped trainer found hung",
            lambda: [e for e in logs.find("launcher", "worker_hung", killed) if e["pid"] == pid],
            up,
            LIVENESS_S + 120,
        )
        detected_s = round(hung[0]["t"] - killed, 3)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)  # nothing of it may stay stopped
    else:
        os.killpg(pid, signal.SIGKILL)
    if part == "tools":
        log, event = worker, "tools_start"
    else:
        log, event = RECOVERED_BY[part]
    again = wait_for(f"{part} to recover", lambda: logs.find(log, event, killed), up, 300)
    return {
        "part": part,
        "worker": worker,
        "point": point,
        "at": round(killed, 3),
        "step": trainer_steps(logs),
        "recovery_s": round(again[0]["t"] - killed, 3),
        **({} if detected_s is None else {"detected_s": detected_s}),
    }
