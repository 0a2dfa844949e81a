"""streamrl.tracing: spans land on the ids they name, files merge into one trace, and a file
cut off mid-write still reads up to its last whole packet."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

from streamrl.tracing import TraceWriter, flow_id, merge, read_trace, whole_packets


def slices(trace: Trace) -> dict[int, list[tuple[str, int, int]]]:
    """Track uuid -> its (name, start, end) slices, from BEGIN/END pairs in order."""
    open_: dict[int, list[tuple[str, int]]] = {}
    out: dict[int, list[tuple[str, int, int]]] = {}
    for p in trace.packet:
        if not p.HasField("track_event"):
            continue
        e = p.track_event
        if e.type == TrackEvent.TYPE_SLICE_BEGIN:
            open_.setdefault(e.track_uuid, []).append((e.name, p.timestamp))
        elif e.type == TrackEvent.TYPE_SLICE_END:
            name, start = open_[e.track_uuid].pop()
            out.setdefault(e.track_uuid, []).append((name, start, p.timestamp))
    return out


def track_names(trace: Trace) -> dict[int, str]:
    return {
        p.track_descriptor.uuid: p.track_descriptor.name or p.track_descriptor.process.process_name
        for p in trace.packet
        if p.HasField("track_descriptor")
    }


def test_concurrent_episodes_each_get_their_own_spans(tmp_path: Path) -> None:
    """32 episodes at once on one event loop, each with 3 environment steps of its own
    latency: every step span is on its episode's track, with the times its episode
    measured, and each step lasts at least its injected latency."""
    w = TraceWriter(tmp_path / "rollout-0.pftrace", "rollout-0", pid=101, chunk_packets=7)

    def latency_s(ep: int, step: int) -> float:
        return 0.005 + 0.001 * ((ep * 3 + step) % 11)

    async def episode(ep: int) -> list[tuple[int, int]]:
        track = w.track("episode", f"g{ep:03d}-m0")
        measured = []
        start = time.time_ns()
        for step in range(3):
            t0 = time.time_ns()
            await asyncio.sleep(latency_s(ep, step))
            t1 = time.time_ns()
            w.span(track, "env_step", t0, t1, args={"step": step})
            measured.append((t0, t1))
        w.span(track, "episode", start, time.time_ns(), flows=[flow_id("group", f"g{ep:03d}")])
        return measured

    async def all_episodes() -> list[list[tuple[int, int]]]:
        return list(await asyncio.gather(*(episode(ep) for ep in range(32))))

    measured = asyncio.run(all_episodes())
    w.close()

    trace = read_trace(merge([w.path]))
    names = track_names(trace)
    by_track = slices(trace)
    assert names[w.process_track] == "rollout-0"
    for ep in range(32):
        track = w.track("episode", f"g{ep:03d}-m0")
        assert names[track] == f"episode g{ep:03d}-m0"
        steps = [(s, e) for n, s, e in by_track[track] if n == "env_step"]
        assert steps == measured[ep]  # exactly what this episode measured, in its order
        for step, (s, e) in enumerate(steps):
            assert e - s >= latency_s(ep, step) * 1e9 * 0.99
        [episode_span] = [x for x in by_track[track] if x[0] == "episode"]
        assert episode_span[1] <= steps[0][0] and steps[-1][1] <= episode_span[2]
    flows = {
        fid for p in trace.packet if p.HasField("track_event") for fid in p.track_event.flow_ids
    }
    assert flows == {flow_id("group", f"g{ep:03d}") for ep in range(32)}


def test_files_merge_into_one_trace_with_a_process_per_worker(tmp_path: Path) -> None:
    paths = []
    for worker, pid in (("grouper-0", 7), ("trainer-0", 8)):
        w = TraceWriter(tmp_path / f"{worker}.pftrace", worker, pid=pid)
        w.span(
            w.track("step", "1"), "train_step", 1_000, 2_000, ends_flows=[flow_id("group", "g1")]
        )
        w.counter("policy_version", 3, 1_500)
        w.close()
        paths.append(w.path)
    trace = read_trace(merge(paths))
    processes = {
        p.track_descriptor.process.pid: p.track_descriptor.process.process_name
        for p in trace.packet
        if p.HasField("track_descriptor") and p.track_descriptor.HasField("process")
    }
    assert processes == {7: "grouper-0", 8: "trainer-0"}
    counters = [
        p.track_event.double_counter_value
        for p in trace.packet
        if p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_COUNTER
    ]
    assert counters == [3.0, 3.0]
    # Each worker's packets carry their own sequence, the first of which starts it afresh.
    sequences = {p.trusted_packet_sequence_id for p in trace.packet}
    assert len(sequences) == 2 and 0 not in sequences
    assert sum(1 for p in trace.packet if p.sequence_flags == 1) == 2


def test_a_file_cut_off_mid_write_reads_to_its_last_whole_packet(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path / "tools-0.pftrace", "tools-0", pid=9, chunk_packets=1)
    track = w.track("call", "c1")
    for i in range(10):
        w.span(track, "sandbox_exec", i * 100, i * 100 + 50)
    w.close()
    data = w.path.read_bytes()
    whole = len(read_trace(data).packet)
    for cut in (len(data) - 1, len(data) - 7, len(data) // 2):
        kept = read_trace(whole_packets(data[:cut]))
        assert 0 < len(kept.packet) < whole
        assert kept.packet[0].track_descriptor.process.process_name == "tools-0"
    assert whole_packets(data) == data


def test_a_span_that_ends_before_it_starts_is_refused(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path / "x.pftrace", "x", pid=1)
    with pytest.raises(ValueError, match="ends"):
        w.span(w.track("episode", "e"), "episode", 10, 5)
    w.close()
