"""Chaos soak (`make soak`, not in CI): a long `streamrl up` of the stub policy with a random
worker SIGKILLed every few seconds and the embedded Redis now and then, then the account.

    .venv/bin/python ops/soak.py                        # 10 minutes, a kill every 5 s
    .venv/bin/python ops/soak.py --minutes 60 --kill-every-s 3 --redis-every-s 120

The run: configs/stub.toml (feeder, rollout, grouper, trainer, two tool workers; the
synthetic task, whose episodes call no tool, so no tool side effect can run twice here:
the kill-anything fault test, tests/faults/test_faults.py, covers those on the tiny model),
a checkpoint every 5 steps, 50 restarts allowed per worker. Every `--kill-every-s` one
worker chosen at random (trainer, rollout, grouper, feeder, tools) is SIGKILLed; every
`--redis-every-s` the embedded Redis is (the launcher restarts each, Redis from its AOF).
Every `--sample-every-s` the soak samples Redis's memory (INFO used_memory), the run
directory's size and the newest checkpoint's queue snapshot size.

At the end (SIGINT, the final checkpoint written) the account, as the fault test keeps it:
from the trainer's train_step lines, the last line of each step is the run's history;
every group of a task the feeder wrote is trained once, dropped by a logged rule, or still
queued at the stop (the final Redis state, read back from the AOF); `lost` is the rest,
`duplicated` the groups trained at two steps of that history. Memory, disk and snapshot
are "flat after warm-up" when the largest sample of the second half after the warm-up
(`--warmup-s`, 120 s) is within `--flat` (1.5x) of the first half's: steady work at a
bounded footprint.

Prints a table and writes `--out` (JSON). Exit 1 when anything was lost or duplicated or
a footprint grew past `--flat`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from streamrl import checkpoints as ckpts  # noqa: E402
from streamrl.config import load_config  # noqa: E402
from streamrl.names import Keys  # noqa: E402
from streamrl.run import rundir  # noqa: E402
from streamrl.run.redis_server import url_from_conf  # noqa: E402
from streamrl.tasks.registry import make_task  # noqa: E402
from tests.faults.test_faults import final_redis_state  # noqa: E402

STUB = REPO / "configs" / "stub.toml"
PARTS = ("trainer", "rollout", "grouper", "feeder", "tools")
# Settings of the soak (not the defaults): restarts enough for a kill every few seconds,
# and caps small enough that the run directory reaches them within minutes (the defaults,
# trace.max_mb 256 and run.log_max_mb 100 x 5 backups, take hours of this run to fill).
SETS = [
    "run.max_restarts=50",
    "run.restart_backoff_s=0.2",
    "trainer.checkpoint_every=5",
    "trainer.eval_every=0",
    "trace.max_mb=16",
    "run.log_max_mb=8",
    "run.log_backups=2",
]


class Tail:
    """The events the account needs (train_step, group_dropped), read from the run's JSON
    logs as they are written, across their roll-overs: the soak's caps delete rolled
    files within minutes, so reading them only at the end would lose history."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.where: dict[str, tuple[int, int]] = {}  # log name -> (inode, offset read)
        self.history: dict[int, list[str]] = {}  # step -> its groups (the last line wins)
        self.dropped: set[str] = set()

    def poll(self) -> None:
        for path in sorted(self.logs.glob("*.log")):
            try:
                inode = path.stat().st_ino
            except OSError:
                continue
            old_inode, offset = self.where.get(path.name, (inode, 0))
            if old_inode != inode:  # rolled over: finish the file it became, then start anew
                self._read(path.with_name(path.name + ".1"), offset, path.stem)
                offset = 0
            self.where[path.name] = (inode, self._read(path, offset, path.stem))

    def _read(self, path: Path, offset: int, worker: str) -> int:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return offset
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            if b'"train_step"' in line and worker.startswith("trainer"):
                e = json.loads(line)
                self.history[int(e["step"])] = list(e["group_ids"])
            elif b'"group_dropped"' in line:
                self.dropped.add(json.loads(line)["group_id"])
        return offset + end


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += (Path(root) / f).stat().st_size
            except OSError:
                continue
    return total


def sample(run_dir: Path) -> dict[str, float]:
    """Redis memory, run-directory size and the newest snapshot's size now (MiB)."""
    out: dict[str, float] = {"t": time.monotonic()}
    url = url_from_conf(run_dir / "redis")
    if url:
        try:
            with redis.Redis.from_url(url, socket_timeout=5) as client:
                info: Any = client.info("memory")
                out["redis_mib"] = int(info["used_memory"]) / 2**20
        except redis.RedisError:
            pass  # Redis being restarted: no sample this time
    out["run_dir_mib"] = dir_bytes(run_dir) / 2**20
    ck = ckpts.latest_complete(run_dir / "checkpoints")
    if ck is not None:
        out["snapshot_mib"] = (ck.path / ckpts.QUEUES).stat().st_size / 2**20
    return out


def account(run_dir: Path, ns: str, tail: Tail) -> dict[str, Any]:
    """Trained, dropped, queued, lost and duplicated groups, as the fault test counts them."""
    tail.poll()
    history = tail.history
    final = ckpts.latest_complete(run_dir / "checkpoints")
    last = final.step if final is not None else 0
    trained_list = [g for s in range(1, last + 1) for g in history.get(s, [])]
    trained = set(trained_list)
    cfg = load_config(STUB, overrides=[f"run.name={ns}", *SETS])
    cursor, _dropped, queued, stats = final_redis_state(run_dir, Keys(ns))
    issued = {
        make_task(cfg.task, cfg.run.seed, c, cfg.rollout.num_generations).group_id
        for c in range(cursor)
    }
    dropped = tail.dropped
    lost = issued - trained - dropped - queued
    return {
        "trainer_steps": last,
        "steps_missing": [s for s in range(1, last + 1) if s not in history],
        "tasks_issued": len(issued),
        "groups_trained": len(trained),
        "groups_dropped": len(dropped),
        "groups_queued_at_stop": len(queued - trained - dropped),
        "groups_lost": len(lost),
        "groups_duplicated": len(trained_list) - len(trained),
        "tool_side_effects_run_twice": 0,  # the synthetic task calls no tool
        "dead_letters": int(stats.get("dead_letters", 0)),
    }


def chaos(
    args: argparse.Namespace, up: subprocess.Popen[bytes], run_dir: Path, tail: Tail
) -> tuple[dict[str, int], list[dict[str, float]]]:
    """Kill a random worker every `kill_every_s`, Redis every `redis_every_s`, and sample
    the footprint every `sample_every_s`, until the soak's time is up (or the run ended)."""
    rng = random.Random(args.seed)
    start = time.monotonic()
    end = start + args.minutes * 60
    kills: dict[str, int] = {}
    samples: list[dict[str, float]] = []
    next_kill, next_redis, next_sample = start + 20, start + args.redis_every_s, start
    while time.monotonic() < end and up.poll() is None:
        now = time.monotonic()
        procs = rundir.orphans(run_dir)
        victim = None
        if now >= next_kill:
            names = [n for n in procs if n.split("-")[0] in PARTS]
            victim = rng.choice(names) if names else None
            next_kill = now + args.kill_every_s
        elif now >= next_redis and rundir.REDIS in procs:
            victim = rundir.REDIS
            next_redis = now + args.redis_every_s
        if victim is not None:
            try:
                os.kill(procs[victim], signal.SIGKILL)
                part = victim.split("-")[0]
                kills[part] = kills.get(part, 0) + 1
            except ProcessLookupError:
                pass
        if now >= next_sample:
            samples.append({**sample(run_dir), "elapsed_s": now - start})
            next_sample = now + args.sample_every_s
        tail.poll()
        time.sleep(0.2)
    return kills, samples


def footprint(samples: list[dict[str, float]], warmup_s: float, factor: float) -> dict[str, Any]:
    """Each footprint after the warm-up: its first and last sample, and the largest of each
    half of the samples; flat when the second half's largest is within `factor` of the
    first half's (a quantity that varies with the work in flight, as a snapshot does, is
    not growing unless its peaks do)."""
    warm = [s for s in samples if s["elapsed_s"] >= warmup_s]
    out: dict[str, Any] = {}
    for k in ("redis_mib", "run_dir_mib", "snapshot_mib"):
        vals = [s[k] for s in warm if k in s]
        if len(vals) >= 4:
            half = len(vals) // 2
            early, late = max(vals[:half]), max(vals[half:])
            out[k] = {
                "after_warmup": round(vals[0], 2),
                "end": round(vals[-1], 2),
                "max_first_half": round(early, 2),
                "max_second_half": round(late, 2),
                "flat": late <= factor * early,
            }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--kill-every-s", type=float, default=5.0)
    p.add_argument("--redis-every-s", type=float, default=90.0)
    p.add_argument("--sample-every-s", type=float, default=15.0)
    p.add_argument("--warmup-s", type=float, default=120.0)
    p.add_argument("--flat", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--run-dir", type=Path, default=REPO / "build" / "soak")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    run_dir = args.run_dir
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    ns = f"soak{os.getpid()}"
    cmd = [sys.executable, "-m", "streamrl_workers.cli", "up", "--config", str(STUB),
           "--steps", "0", "--run-dir", str(run_dir), "--set", f"run.name={ns}"]  # fmt: skip
    for s in SETS:
        cmd += ["--set", s]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(run_dir.parent / "soak-up.out", "wb") as out_log:
        up = subprocess.Popen(cmd, cwd=REPO, stdout=out_log, stderr=subprocess.STDOUT)
        tail = Tail(run_dir / "logs")
        kills, samples = chaos(args, up, run_dir, tail)
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 600
        while up.poll() is None and time.monotonic() < deadline:  # the last steps' lines
            tail.poll()
            time.sleep(0.2)
        code = up.wait(timeout=60)
    samples.append({**sample(run_dir), "elapsed_s": time.monotonic() - start})
    result: dict[str, Any] = {
        "minutes": round((time.monotonic() - start) / 60, 2),
        "exit_code": code,
        "kills": kills,
        "kills_total": sum(kills.values()),
        **account(run_dir, ns, tail),
        "footprint": footprint(samples, args.warmup_s, args.flat),
    }
    result["ok"] = (
        code == 0
        and result["groups_lost"] == 0
        and result["groups_duplicated"] == 0
        and not result["steps_missing"]
        and all(v["flat"] for v in result["footprint"].values())
    )
    print(json.dumps(result, indent=2))
    print("\n| what | value |\n|---|---:|")
    for k in ("minutes", "kills_total", "trainer_steps", "groups_trained", "groups_dropped",
              "groups_queued_at_stop", "groups_lost", "groups_duplicated"):  # fmt: skip
        print(f"| {k} | {result[k]} |")
    for k, v in result["footprint"].items():
        span = f"{v['max_first_half']} -> {v['max_second_half']}"
        print(f"| {k}, largest of each half after warm-up | {span} |")
    if args.out:
        args.out.write_text(json.dumps({**result, "samples": samples}, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
