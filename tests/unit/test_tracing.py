"""streamrl.obs.tracing: spans land on the ids they name, files merge into one trace, and a file
cut off mid-write still reads up to its last whole packet."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TracePacket, TrackEvent

from streamrl.config import TraceConfig
from streamrl.obs.tracing import (
    Tracer,
    TraceWriter,
    flow_id,
    merge,
    merge_run,
    open_tracer,
    read_trace,
    trace_files,
    trace_path,
    whole_packets,
    whole_size,
)
from streamrl_workers.cli import main as cli_main


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


# -- the hand encoding, the Tracer ------------------------------------------------------------


def test_hand_encoded_packets_are_those_the_protobuf_classes_write(tmp_path: Path) -> None:
    """Spans (with flows and arguments) and counters, encoded by hand, parse to exactly the
    packets the perfetto package's classes build for them."""
    w = TraceWriter(tmp_path / "w.pftrace", "w", pid=3)
    track = w.track("episode", "e1")
    w.span(track, "env.step", 5, 2**62, flows=[flow_id("traj", "e1"), 7], ends_flows=[2**64 - 1],
           args={"step": 3, "ok": True, "x": 0.5, "who": "me"})  # fmt: skip
    w.counter("active_episodes", 12.5, 1_700_000_000_000_000_000)
    w.close()
    got = [p for p in read_trace(w.path.read_bytes()).packet if p.HasField("track_event")]
    seq = got[0].trusted_packet_sequence_id
    begin = TrackEvent(type=TrackEvent.TYPE_SLICE_BEGIN, track_uuid=track, name="env.step")
    begin.flow_ids.extend([flow_id("traj", "e1"), 7])
    begin.terminating_flow_ids.extend([2**64 - 1])
    # each value in the field of its type, written out (not the encoder's own dispatch)
    begin.debug_annotations.add(name="step", int_value=3)
    begin.debug_annotations.add(name="ok", bool_value=True)
    begin.debug_annotations.add(name="x", double_value=0.5)
    begin.debug_annotations.add(name="who", string_value="me")
    end = TrackEvent(type=TrackEvent.TYPE_SLICE_END, track_uuid=track)
    counter_track = next(
        p.track_descriptor.uuid
        for p in read_trace(w.path.read_bytes()).packet
        if p.track_descriptor.name == "active_episodes"
    )
    sample = TrackEvent(type=TrackEvent.TYPE_COUNTER, track_uuid=counter_track)
    sample.double_counter_value = 12.5
    want = [
        TracePacket(timestamp=5, track_event=begin, trusted_packet_sequence_id=seq),
        TracePacket(timestamp=2**62, track_event=end, trusted_packet_sequence_id=seq),
        TracePacket(
            timestamp=1_700_000_000_000_000_000, track_event=sample, trusted_packet_sequence_id=seq
        ),
    ]
    assert got == want


def test_a_disabled_tracer_records_nothing(tmp_path: Path) -> None:
    t = Tracer.disabled()
    assert not t.enabled and t.path is None
    track = t.track("episode", "e")
    t.span(track, "episode", 10, 5)  # not even checked: nothing is recorded
    t.counter("active_episodes", 1, 10)
    t.flush()
    t.close()
    assert t.shared_ns(100) == 100 and t.local_ns(100) == 100
    disabled = open_tracer(TraceConfig(enabled=False), tmp_path, "rollout-0", _FakeRedisTime(0))
    assert not disabled.enabled
    assert not (tmp_path / "traces").exists()


def test_the_timer_writes_what_is_held_within_flush_s(tmp_path: Path) -> None:
    """Packets held (far from a full chunk) reach the file within flush_s, without a
    flush or close; closed, the tracer records nothing more."""
    w = TraceWriter(tmp_path / "t.pftrace", "t", pid=1, chunk_packets=10_000)
    t = Tracer(w, flush_s=0.05)
    try:
        t.span(t.track("episode", "e"), "episode", 1_000, 2_000)
        assert w.path.stat().st_size == 0  # held
        deadline = time.monotonic() + 5
        while w.path.stat().st_size == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        spans = slices(read_trace(w.path.read_bytes()))
        assert [s for ss in spans.values() for s in ss] == [("episode", 1_000, 2_000)]
    finally:
        t.close()
    size = w.path.stat().st_size
    t.span(t.track("episode", "e"), "episode", 3_000, 4_000)
    t.close()
    assert w.path.stat().st_size == size


class _FakeRedisTime:
    """TIME of a server whose clock runs `ahead_ns` ahead of this host's."""

    def __init__(self, ahead_ns: int) -> None:
        self.ahead_ns = ahead_ns

    def time(self) -> tuple[int, int]:
        now = time.time_ns() + self.ahead_ns
        return now // 1_000_000_000, now // 1000 % 1_000_000


def test_every_timestamp_is_moved_to_the_redis_clock(tmp_path: Path) -> None:
    """A host whose clock is 5 s behind Redis's: its spans and counters are written on
    Redis's clock (within the round trip and TIME's microsecond), and a time handed to
    another process travels on it too."""
    ahead = 5_000_000_000
    cfg = TraceConfig(flush_s=60)
    t = open_tracer(cfg, tmp_path, "grouper-0", _FakeRedisTime(ahead))
    assert abs(t.offset_ns - ahead) < 2_000_000
    t.span(t.track("group", "g1"), "group.wait", 1_000, 2_000)
    t.counter("groups_total", 3, 1_500)
    assert t.local_ns(t.shared_ns(123)) == 123 and t.shared_ns(0) == t.offset_ns
    t.close()
    trace = read_trace((tmp_path / "traces" / "grouper-0.pftrace").read_bytes())
    stamps = [p.timestamp for p in trace.packet if p.HasField("track_event")]
    assert stamps == [1_000 + t.offset_ns, 2_000 + t.offset_ns, 1_500 + t.offset_ns]


def test_a_restarted_worker_appends_after_the_last_whole_packet(tmp_path: Path) -> None:
    """A worker killed mid-write leaves part of a packet; its restart cuts the file back to
    the last whole packet before appending, so the merge keeps what both processes wrote
    (appended after the fragment, the new process's packets would all be lost)."""
    path = tmp_path / "rollout-0.pftrace"
    w = TraceWriter(path, "rollout-0", pid=10, chunk_packets=1)
    w.span(w.track("episode", "a"), "episode", 100, 200)
    w.close()
    whole = path.read_bytes()
    with open(path, "ab") as f:  # a crash in the middle of a chunk's write
        f.write(whole[len(whole) // 2 :][:9])
    assert len(read_trace(whole_packets(path.read_bytes())).packet) == len(read_trace(whole).packet)

    w2 = TraceWriter(path, "rollout-0", pid=11, chunk_packets=1)
    assert w2.cut_bytes == 9 and path.read_bytes().startswith(whole)
    w2.span(w2.track("episode", "b"), "episode", 300, 400)
    w2.close()
    assert whole_packets(path.read_bytes()) == path.read_bytes()  # every byte in a packet
    trace = read_trace(merge([path]))
    processes = [
        p.track_descriptor.process.pid
        for p in trace.packet
        if p.track_descriptor.HasField("process")
    ]
    assert processes == [10, 11]
    spans = sorted(s for ss in slices(trace).values() for s in ss)
    assert spans == [("episode", 100, 200), ("episode", 300, 400)]
    assert whole_size(path, block=7) == path.stat().st_size  # read a block at a time too


def test_the_run_merge_writes_one_trace_and_says_what_it_holds(tmp_path: Path) -> None:
    for worker, pid in (("rollout-0", 1), ("trainer-0", 2)):
        w = TraceWriter(trace_path(tmp_path, worker), worker, pid)
        w.span(w.track("episode", "e"), "episode", 1, 2, flows=[flow_id("traj", "e")])
        w.span(w.track("step", "1"), "train.step", 3, 4, ends_flows=[flow_id("group", "g")])
        w.counter("rss_mb", 100.0, 5)
        w.close()
    out = tmp_path / "trace.pftrace"
    summary = merge_run(tmp_path, out)
    assert sorted(summary.processes) == [(1, "rollout-0"), (2, "trainer-0")]
    assert summary.spans == {"episode": 2, "train.step": 2}
    assert summary.counters == {"rss_mb": 2}
    assert (summary.flows, summary.flows_ended) == (2, 2)
    assert read_trace(out.read_bytes()) == read_trace(merge(trace_files(tmp_path)))


def test_batched_spans_are_the_packets_the_protobuf_classes_write(tmp_path: Path) -> None:
    """Spans of real timestamps are batched and encoded together at the flush (a template
    per name and flow count, filled by numpy): each parses to the packets the perfetto
    classes build, the writer's offset added, flows and ended flows in place."""
    w = TraceWriter(tmp_path / "b.pftrace", "b", pid=4)
    w.offset_ns = -1_234_567
    now = time.time_ns()
    want = []
    for i in range(50):
        track = w.track("episode", f"e{i % 7}")
        flows = [flow_id("traj", f"e{i}")] * (i % 2)
        ends = [flow_id("group", f"g{j}") for j in range(i % 3)]
        name = ("episode", "env.step", "group.wait")[i % 3]
        start, end = now + 1000 * i, now + 1000 * i + 17 * i
        w.span(track, name, start, end, flows=flows, ends_flows=ends)
        begin = TrackEvent(type=TrackEvent.TYPE_SLICE_BEGIN, track_uuid=track, name=name)
        begin.flow_ids.extend(flows)
        begin.terminating_flow_ids.extend(ends)
        end_event = TrackEvent(type=TrackEvent.TYPE_SLICE_END, track_uuid=track)
        want.append((start + w.offset_ns, begin, end + w.offset_ns, end_event))
    w.close()
    packets = [p for p in read_trace(w.path.read_bytes()).packet if p.HasField("track_event")]
    seq = packets[0].trusted_packet_sequence_id
    got = [
        (a.timestamp, a.track_event, b.timestamp, b.track_event)
        for a, b in zip(packets[::2], packets[1::2], strict=True)
    ]
    assert sorted(got, key=lambda x: x[0]) == want
    assert {p.trusted_packet_sequence_id for p in packets} == {seq}


def test_streamrl_trace_merges_a_run_and_refuses_one_without_traces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["trace", str(tmp_path)]) == 1
    assert "no trace files" in capsys.readouterr().err
    for worker, pid in (("grouper-0", 5), ("trainer-0", 6)):
        w = TraceWriter(trace_path(tmp_path, worker), worker, pid)
        w.span(w.track("group", "g"), "group.wait", 10, 20, flows=[flow_id("group", "g")])
        w.close()
    assert cli_main(["trace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "processes (2):" in out and "grouper-0 (pid 5)" in out and "trainer-0 (pid 6)" in out
    assert "group.wait" in out and "flows: 2 started or continued, 0 ended" in out
    merged = read_trace((tmp_path / "trace.pftrace").read_bytes())
    assert merged == read_trace(merge(trace_files(tmp_path)))


def test_the_summary_counts_a_rolled_over_process_once(tmp_path: Path) -> None:
    """Each file a writer rolls over to names its process again; the merged summary (what
    `streamrl trace` prints) lists a process once however many files it wrote, and counts
    every counter sample by its counter's name."""
    w = TraceWriter(trace_path(tmp_path, "rollout-0"), "rollout-0", pid=7, chunk_packets=16,
                    max_bytes=4_000)  # fmt: skip
    track = w.track("episode", "g1-m0")
    for i in range(400):
        w.span(track, "env_step", 1000 + i * 10, 1005 + i * 10)
    w.counter("rss_mb", 1.0, 5000)
    w.close()
    assert w.rollovers >= 1
    summary = merge_run(tmp_path, tmp_path / "trace.pftrace")
    assert len(trace_files(tmp_path)) == 2
    assert summary.processes == [(7, "rollout-0")]
    assert summary.counters == {"rss_mb": 1}


def test_a_trace_past_its_cap_rolls_over_and_each_file_reads_alone(tmp_path: Path) -> None:
    """Review part 3: a worker's trace grew without bound. Past `max_bytes` it rolls over
    to <worker>.1.pftrace (replacing the one before): at most about twice the cap on disk,
    and each file names the process and its tracks on its own."""
    cap = 20_000
    w = TraceWriter(tmp_path / "rollout-0.pftrace", "rollout-0", pid=7, chunk_packets=16,
                    max_bytes=cap)  # fmt: skip
    track = w.track("episode", "g1-m0")  # described once, at the start
    t = time.time_ns()
    for i in range(3000):
        w.span(track, "env_step", t + i * 1000, t + i * 1000 + 500)
    w.close()
    assert w.rollovers >= 2
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["rollout-0.1.pftrace", "rollout-0.pftrace"]
    for path in tmp_path.iterdir():
        assert path.stat().st_size <= cap + 16 * 200  # the cap plus a chunk at most
        trace = read_trace(path.read_bytes())
        names = track_names(trace)
        assert names[w.process_track] == "rollout-0" and names[track] == "episode g1-m0"
        assert slices(trace)[track], path  # its spans, on a named track
    newest = slices(read_trace((tmp_path / "rollout-0.pftrace").read_bytes()))[track]
    assert newest[-1][2] == t + 2999 * 1000 + 500  # the last span is in the live file
