"""Traces written by the real parts, read back from the files with the protobuf classes:
episodes at 32 at once on the episode runner (each step's span its injected latency, each
span on its own episode's track), tool calls through a real tools worker process (both
sides of each call on its track), a wait on the weight-sync lock."""

from __future__ import annotations

import asyncio
import functools
import itertools
import statistics
import time
from pathlib import Path

import redis
import structlog
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

from streamrl.agents.agents import ToolAgent
from streamrl.agents.base import Action, Agent, Environment, Reset, StepResult
from streamrl.config import ToolsConfig, TraceConfig, parse_config
from streamrl.names import Keys
from streamrl.obs.tracing import (
    TRAJ_FLOW,
    Span,
    Tracer,
    TraceWriter,
    flow_id,
    merge,
    open_tracer,
    read_trace,
    trace_files,
    trace_path,
)
from streamrl.rollout.episode import EpisodeRunner
from streamrl.rollout.stub import StubDialogue, StubServer
from streamrl.rollout.weights import SyncLock
from streamrl.tools.client import ToolClient
from streamrl.transport import make_async_client, make_client
from streamrl.wire import Task
from tests.helpers import spawn_worker, stop, wait_for_rq_worker

LOG = structlog.get_logger()
EPISODES, STEPS = 32, 3
TOLERANCE_NS = 5_000_000
SKEW_NS = 1_000_000  # two processes on one host: far more than their offsets' error


def spans_by_track(trace: Trace) -> dict[int, list[tuple[str, int, int]]]:
    """Track uuid -> its (name, start, end) slices, from BEGIN/END pairs (each span's two
    packets are written together; spans are not in time order in a file)."""
    open_: dict[int, list[tuple[str, int]]] = {}
    out: dict[int, list[tuple[str, int, int]]] = {}
    for p in trace.packet:
        e = p.track_event
        if not p.HasField("track_event"):
            continue
        if e.type == TrackEvent.TYPE_SLICE_BEGIN:
            open_.setdefault(e.track_uuid, []).append((e.name, p.timestamp))
        elif e.type == TrackEvent.TYPE_SLICE_END:
            name, start = open_[e.track_uuid].pop()
            out.setdefault(e.track_uuid, []).append((name, start, p.timestamp))
    return out


def tracks(trace: Trace) -> dict[str, tuple[int, int]]:
    """Track name -> (uuid, parent uuid); process tracks by their process name."""
    return {
        p.track_descriptor.name or p.track_descriptor.process.process_name: (
            p.track_descriptor.uuid,
            p.track_descriptor.parent_uuid,
        )
        for p in trace.packet
        if p.HasField("track_descriptor")
    }


def latency_s(ep: int, step: int) -> float:
    """Injected, distinct per episode at each step, 11 ms apart (> 2 x the tolerance): a
    step span on another episode's track could match no other latency of its step."""
    slot = (ep * (1, 5, 13)[step] + (0, 3, 7)[step]) % EPISODES
    return 0.010 + 0.011 * slot


class SleepyEnvironment(Environment):
    """STEPS steps, each sleeping its injected latency; the last ends the episode. Each
    step's own duration as the environment measured it (the latency plus what the OS and
    the event loop added to the sleep) is noted in `took_ns`."""

    def __init__(self, ep: int, took_ns: dict[tuple[int, int], int]) -> None:
        self.ep = ep
        self.steps = 0
        self.took_ns = took_ns

    async def reset(self) -> Reset:
        return Reset(prompt=f"episode {self.ep}")

    async def step(self, action: Action, call_prefix: str) -> StepResult:
        injected = latency_s(self.ep, self.steps)
        t0 = time.time_ns()
        await asyncio.sleep(injected)
        self.took_ns[(self.ep, self.steps)] = time.time_ns() - t0
        self.steps += 1
        return StepResult(observations=["ok"], done=self.steps == STEPS, reward=1.0)


def task(ep: int) -> Task:
    return Task(task_id=f"t{ep}", group_id=f"g{ep:03d}", kind="sleepy", prompt="", answer="",
                num_generations=1, cursor=ep)  # fmt: skip


def test_32_concurrent_episodes_each_step_span_is_its_injected_latency(
    rclient: redis.Redis, tmp_path: Path
) -> None:
    """32 episodes at once on the episode runner (the stub's model calls overlapping, as in
    a batched engine), each step sleeping its own latency: in the trace file, each
    episode's track holds its episode span, its 3 model calls (queue, then decode) and its
    3 env.step spans, each at least the step as the environment measured it (itself at
    least the latency injected for that episode and step), and in the median over the 96
    steps within 5 ms of it; every span inside its episode's span; the episode span starts
    its group's flow.

    The median, not every step: the span also holds the event loop's way into and out of
    the step, which on loaded cores (a parallel test process) took 66 ms once; a span on the
    wrong track or measuring the wrong thing is off by 11 ms or more in most steps."""
    cfg = parse_config(
        {"model": {"kind": "stub"}, "rollout": {"max_concurrency": EPISODES, "max_steps": STEPS}}
    )
    tracer = open_tracer(TraceConfig(), tmp_path, "rollout-0", rclient)
    server = StubServer(latency_s=0.002, turn_tokens=8)
    runner = EpisodeRunner(server, StubDialogue, cfg.rollout, 0, "rollout-0", LOG, tracer=tracer)

    took_ns: dict[tuple[int, int], int] = {}

    def make(ep: int) -> tuple[Agent, Environment]:
        return ToolAgent(), SleepyEnvironment(ep, took_ns)

    async def go() -> None:
        trajs = await asyncio.gather(
            *(runner.run(task(ep), 0, functools.partial(make, ep)) for ep in range(EPISODES))
        )
        assert [t.status for t in trajs] == ["ok"] * EPISODES

    asyncio.run(go())
    tracer.close()
    trace = read_trace(merge(trace_files(tmp_path)))
    names, by_track = tracks(trace), spans_by_track(trace)
    process = names["rollout-0"][0]
    excess: list[int] = []
    for ep in range(EPISODES):
        tid = f"g{ep:03d}-m0"
        uuid, parent = names[f"episode {tid}"]
        assert parent == process
        spans = sorted(by_track[uuid], key=lambda x: x[1])  # by time (files are not)
        [(_, start, end)] = [s for s in spans if s[0] == Span.EPISODE]
        steps = [(s, e) for n, s, e in spans if n == Span.ENV_STEP]
        assert len(steps) == STEPS
        for step, (s, e) in enumerate(steps):
            injected, took = int(latency_s(ep, step) * 1e9), took_ns[(ep, step)]
            assert injected <= took <= e - s, (ep, step, e - s, took)
            excess.append(e - s - took)
        calls = [n for n, _, _ in spans if n in (Span.MODEL_QUEUE, Span.MODEL_DECODE)]
        assert calls == [Span.MODEL_QUEUE, Span.MODEL_DECODE] * STEPS
        assert all(start <= s <= e <= end for n, s, e in spans)
        # each phase in order: queue, decode, step, queue, ...
        inner = sorted((s, e) for n, s, e in spans if n != Span.EPISODE)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(inner))
    assert statistics.median(excess) <= TOLERANCE_NS, sorted(excess)
    flows = {
        f
        for p in trace.packet
        if p.track_event.name == Span.EPISODE
        for f in p.track_event.flow_ids
    }
    assert flows == {flow_id(TRAJ_FLOW, f"g{ep:03d}-m0") for ep in range(EPISODES)}


def test_a_tool_call_is_traced_by_its_caller_and_by_the_tools_worker(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Calls through a real tools worker process (`streamrl worker tools`, its tracer opened
    by the CLI): on each call's track, the caller's tool.wait holding its tool.enqueue, and
    in the tools worker's own process the call's tool.queue then tool.exec, both inside the
    caller's wait (one clock: the Redis server's)."""
    w = spawn_worker("tools", redis_url, keys.ns, tmp_path)
    tracer = open_tracer(TraceConfig(), tmp_path, "rollout-0", rclient)
    ids = [f"e{i}-0-0" for i in range(4)]
    try:
        wait_for_rq_worker(rclient, keys.tool_queue)

        async def go() -> None:
            aclient = make_async_client(redis_url)
            client = ToolClient(
                make_client(redis_url), aclient, keys, ToolsConfig(), LOG, tracer=tracer
            )
            try:
                results = await asyncio.gather(
                    *(client.call("calculator", '{"expression": "6*7"}', c) for c in ids)
                )
                assert [r.output for r in results] == ["42"] * len(ids)
            finally:
                await aclient.aclose()

        asyncio.run(go())
    finally:
        tracer.close()
        assert stop(w) == 0  # SIGTERM: the worker closes its tracer on the way out
    assert trace_path(tmp_path, "tools-0").exists()
    trace = read_trace(merge(trace_files(tmp_path)))
    names, by_track = tracks(trace), spans_by_track(trace)
    rollout, tools = names["rollout-0"][0], names["tools-0"][0]
    uuids = {}
    for p in trace.packet:
        d = p.track_descriptor
        if p.HasField("track_descriptor") and d.name.startswith("call "):
            uuids[(d.parent_uuid, d.name[5:])] = d.uuid
    for c in ids:
        mine = sorted(by_track[uuids[(rollout, c)]], key=lambda x: x[1])
        assert [n for n, _, _ in mine] == [Span.TOOL_WAIT, Span.TOOL_ENQUEUE]
        (_, ws, we), (_, es, ee) = mine
        assert ws <= es <= ee <= we
        theirs = sorted(by_track[uuids[(tools, c)]], key=lambda x: x[1])
        assert [n for n, _, _ in theirs] == [Span.TOOL_QUEUE, Span.TOOL_EXEC]
        (_, qs, qe), (_, xs, xe) = theirs
        assert qs <= qe <= xs <= xe
        # Across processes, each clock's offset to Redis's is known to half a round trip.
        assert es - SKEW_NS <= qs and xe <= we + SKEW_NS, (es, qs, xe, we)


def test_a_wait_on_the_weight_sync_lock_is_a_span(tmp_path: Path) -> None:
    """A sync holds the lock 50 ms: the wait for it is a weights.lock_wait span of that
    length on the waiter's track; an open lock is passed without one."""
    path = tmp_path / "r.pftrace"
    tracer = Tracer(TraceWriter(path, "rollout-0", 1))
    lock = SyncLock(tracer)
    track = tracer.track("rollout", "starter")

    async def go() -> float:
        await lock.wait_open(track)  # open: no span
        lock.close()
        start = time.monotonic()
        waiter = asyncio.create_task(lock.wait_open(track))
        await asyncio.sleep(0.05)
        lock.reopen()
        await waiter
        return time.monotonic() - start

    waited = asyncio.run(go())
    tracer.close()
    [(name, s, e)] = spans_by_track(read_trace(path.read_bytes()))[track]
    assert name == Span.WEIGHTS_LOCK_WAIT
    assert 0.05 <= (e - s) / 1e9 <= waited
