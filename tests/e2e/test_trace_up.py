"""`streamrl up` of the stub pipeline, then `streamrl trace`: the merged trace parses with the
protobuf classes, has one process per worker and the spans of every kind such a run makes,
and its flows link each episode to its group and each group to the train step that used it.

A stub run makes no tool call (the synthetic task calls none) and need not wait on the
weight-sync lock: tool.wait, tool.enqueue, tool.queue, tool.exec and weights.lock_wait are
covered by tests/integration/test_traces.py, against a real tools worker and a real lock.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent

from streamrl.obs.metrics import GROUPS_TOTAL, RSS_MB, TRAJECTORIES_PER_MIN
from streamrl.obs.report import breakdowns_of, load_run, write_report
from streamrl.obs.tracing import GROUP_FLOW, TRAJ_FLOW, Span, flow_id, read_trace
from tests.e2e.test_up import summary_of, up
from tests.helpers import REPO

pytestmark = pytest.mark.e2e

STUB = REPO / "configs" / "stub.toml"
GROUPS, PER_STEP, G = 250, 25, 4
# What a stub run always makes; weights.lock_wait only when a read meets a sync.
STUB_SPANS = set(Span.ALL) - {
    Span.TOOL_WAIT,
    Span.TOOL_ENQUEUE,
    Span.TOOL_QUEUE,
    Span.TOOL_EXEC,
    Span.WEIGHTS_LOCK_WAIT,
}


@pytest.mark.timeout(180)
def test_the_merged_trace_of_a_stub_run(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(GROUPS)))
    run_dir = tmp_path / "run"
    proc = up(
        run_dir,
        GROUPS // PER_STEP,
        f'task.dataset="{data}"',
        "task.epochs=1",
        f'model.cache_dir="{tmp_path / "cache"}"',
        config=STUB,
    )
    out, _ = proc.communicate(timeout=170)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["groups_trained"] == GROUPS

    merged = tmp_path / "merged.pftrace"
    cli = subprocess.run(
        [sys.executable, "-m", "streamrl_workers.cli", "trace", str(run_dir), "-o", str(merged)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cli.returncode == 0, cli.stderr
    print(cli.stdout)
    trace = read_trace(merged.read_bytes())

    # One process per worker, by the pid the launcher started.
    processes = [
        (p.track_descriptor.process.process_name, p.track_descriptor.process.pid)
        for p in trace.packet
        if p.track_descriptor.HasField("process")
    ]
    assert sorted(processes) == sorted(s["worker_pids"].items())
    assert f"processes ({len(processes)}):" in cli.stdout

    names: dict[int, str] = {}
    parents: dict[int, int] = {}
    process_of: dict[int, str] = {}
    for p in trace.packet:
        d = p.track_descriptor
        if p.HasField("track_descriptor"):
            names[d.uuid] = d.name or d.process.process_name
            parents[d.uuid] = d.parent_uuid
            if d.HasField("process"):
                process_of[d.uuid] = d.process.process_name
    begins = [
        p.track_event
        for p in trace.packet
        if p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN
    ]
    spans = Counter(e.name for e in begins)
    assert set(spans) >= STUB_SPANS, f"missing: {STUB_SPANS - set(spans)}"
    assert set(spans) <= set(Span.ALL)
    assert spans[Span.EPISODE] == G * GROUPS
    assert spans[Span.GROUP_WAIT] == GROUPS
    assert spans[Span.TRAIN_STEP] == GROUPS // PER_STEP
    assert spans[Span.ENV_STEP] == spans[Span.MODEL_DECODE] == 2 * G * GROUPS
    assert spans[Span.CHECKPOINT_SAVE] >= 1

    def where(e: TrackEvent) -> str:
        return process_of[parents[e.track_uuid]]

    # Each episode on its own track in the rollout worker, each group on its own in the
    # grouper's, the train steps in the trainer's.
    episodes = [e for e in begins if e.name == Span.EPISODE]
    assert {where(e) for e in episodes} == {"rollout-0"}
    assert len({e.track_uuid for e in episodes}) == len(episodes)
    waits = [e for e in begins if e.name == Span.GROUP_WAIT]
    assert {where(e) for e in waits} == {"grouper-0"}
    steps = [e for e in begins if e.name == Span.TRAIN_STEP]
    assert {where(e) for e in steps} == {"trainer-0"}

    # Flows: episode -> its group's wait -> the train step that trained the group.
    trajs = {f for e in episodes for f in e.flow_ids}
    assert len(trajs) == G * GROUPS
    assert {f for e in waits for f in e.terminating_flow_ids} == trajs
    groups = {f for e in waits for f in e.flow_ids}
    assert {f for e in steps for f in e.terminating_flow_ids} == groups
    group_ids = {names[e.track_uuid].removeprefix("group ") for e in waits}
    assert groups == {flow_id(GROUP_FLOW, g) for g in group_ids}
    assert trajs == {flow_id(TRAJ_FLOW, f"{g}-m{m}") for g in group_ids for m in range(G)}

    # The counters sampled into each worker's trace (the metrics sink), and the report of
    # this real run read back from its files.
    run = load_run(run_dir)
    assert run.series(TRAJECTORIES_PER_MIN).keys() == {"rollout-0"}
    assert max(v for _, v in run.series(GROUPS_TOTAL)["grouper-0"]) >= GROUPS
    assert "queue.trajectories.depth" in run.counters["grouper-0"]
    assert all(RSS_MB in c for c in run.counters.values()), run.counters.keys()
    md = write_report(run_dir).read_text()
    assert "ottleneck" in md and "rollout-0" in md
    parts = breakdowns_of(run)["trainer-0"]  # seconds, summing to its wall time
    start, end = run.walls["trainer-0"]
    assert parts["busy"] > 0 and abs(sum(parts.values()) - (end - start)) < 1e-6, parts
