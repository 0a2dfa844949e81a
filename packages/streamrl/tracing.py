"""Perfetto traces, written by explicit id (issue 16, first part: the writer and the merge).

A worker records a span with the ids it belongs to (`TraceWriter.span(track, name, start,
end)`, the track named by kind and id: `track("episode", traj_id)`), after the fact, with the
start and end it measured itself. Nothing is inferred from a per-thread or per-task stack,
so under any concurrency a span lands on the episode, call or step it names (Tunix's shared
span stack put 17 of 64 episode spans on the wrong episode at 32 concurrent ones).

Each worker streams its own file, `RUN_DIR/traces/<worker>.pftrace`: a sequence of
serialized `Trace` messages (the perfetto package's protobuf classes), written in chunks of
whole packets, so a crash loses at most the chunk not yet written and what is on disk
always parses. Serialized `Trace` messages concatenate into one valid `Trace` (a repeated
field), so `merge` is a concatenation: one process per worker (its process track), each
worker's tracks under it. Timestamps are wall-clock nanoseconds (`time.time_ns()`), the
one clock every host shares once NTP-synced; offsets between unsynced hosts are not yet
corrected.

Flow arrows (an episode to its group, a group to the train step that used it) link spans
by `flow_id(kind, key)`: the same id from both ends, in any process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO

import xxhash
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import (
    CounterDescriptor,
    DebugAnnotation,
    ProcessDescriptor,
    Trace,
    TracePacket,
    TrackDescriptor,
    TrackEvent,
)

# TracePacket.sequence_flags: the first packet of a writer's sequence starts it afresh.
_SEQ_INCREMENTAL_STATE_CLEARED = 1

Arg = str | int | float | bool


def _id64(text: str) -> int:
    """A stable 64-bit id (track uuids and flow ids must agree across processes)."""
    return xxhash.xxh64_intdigest(text.encode()) or 1  # 0 means "unset" in the protos


def flow_id(kind: str, key: str) -> int:
    """The flow id that links the spans of one thing (`kind` "group", `key` its id)."""
    return _id64(f"flow/{kind}/{key}")


class TraceWriter:
    """One worker's trace file. Not thread-safe: one writer per thread, or a lock around it.

    `chunk_packets`: packets held before they are written in one write (and flushed)."""

    def __init__(self, path: Path, worker: str, pid: int, chunk_packets: int = 256) -> None:
        if chunk_packets < 1:
            raise ValueError(f"chunk_packets must be >= 1, got {chunk_packets}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.worker = worker
        self.chunk_packets = chunk_packets
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 (closed in close())
        self._pending: list[TracePacket] = []
        self._tracks: set[int] = set()
        self._sequence = _id64(f"sequence/{worker}/{pid}") & 0xFFFFFFFF or 1
        self._first = True
        self.process_track = _id64(f"process/{worker}/{pid}")
        desc = TrackDescriptor(
            uuid=self.process_track, process=ProcessDescriptor(pid=pid, process_name=worker)
        )
        self._add(TracePacket(track_descriptor=desc))

    def _add(self, packet: TracePacket) -> None:
        packet.trusted_packet_sequence_id = self._sequence
        if self._first:
            packet.sequence_flags = _SEQ_INCREMENTAL_STATE_CLEARED
            self._first = False
        self._pending.append(packet)
        if len(self._pending) >= self.chunk_packets:
            self.flush()

    def track(self, kind: str, key: str) -> int:
        """The uuid of the track of `kind` `key` (an episode, a tool call, a step) under this
        worker's process; its descriptor is written the first time."""
        uuid = _id64(f"track/{self.worker}/{kind}/{key}")
        if uuid not in self._tracks:
            self._tracks.add(uuid)
            desc = TrackDescriptor(uuid=uuid, parent_uuid=self.process_track, name=f"{kind} {key}")
            self._add(TracePacket(track_descriptor=desc))
        return uuid

    def span(
        self,
        track: int,
        name: str,
        start_ns: int,
        end_ns: int,
        *,
        flows: Sequence[int] = (),
        ends_flows: Sequence[int] = (),
        args: Mapping[str, Arg] | None = None,
    ) -> None:
        """A slice from `start_ns` to `end_ns` (wall clock) on `track`; `flows` start or
        continue flow arrows from it, `ends_flows` end them there."""
        if end_ns < start_ns:
            raise ValueError(f"span {name!r} ends ({end_ns}) before it starts ({start_ns})")
        begin = TrackEvent(type=TrackEvent.TYPE_SLICE_BEGIN, track_uuid=track, name=name)
        begin.flow_ids.extend(flows)
        begin.terminating_flow_ids.extend(ends_flows)
        for key, value in (args or {}).items():
            begin.debug_annotations.append(_annotation(key, value))
        self._add(TracePacket(timestamp=start_ns, track_event=begin))
        end = TrackEvent(type=TrackEvent.TYPE_SLICE_END, track_uuid=track)
        self._add(TracePacket(timestamp=end_ns, track_event=end))

    def counter(self, name: str, value: float, ts_ns: int) -> None:
        """One sample of the counter `name` (its track is made the first time)."""
        uuid = _id64(f"counter/{self.worker}/{name}")
        if uuid not in self._tracks:
            self._tracks.add(uuid)
            desc = TrackDescriptor(
                uuid=uuid, parent_uuid=self.process_track, name=name, counter=CounterDescriptor()
            )
            self._add(TracePacket(track_descriptor=desc))
        event = TrackEvent(type=TrackEvent.TYPE_COUNTER, track_uuid=uuid)
        event.double_counter_value = float(value)
        self._add(TracePacket(timestamp=ts_ns, track_event=event))

    def flush(self) -> None:
        """Write the packets held, as one chunk of whole packets."""
        if not self._pending:
            return
        trace = Trace()
        trace.packet.extend(self._pending)
        self._pending.clear()
        self._file.write(trace.SerializeToString())
        self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()


def _annotation(key: str, value: Arg) -> DebugAnnotation:
    a = DebugAnnotation(name=key)
    if isinstance(value, bool):
        a.bool_value = value
    elif isinstance(value, int):
        a.int_value = value
    elif isinstance(value, float):
        a.double_value = value
    else:
        a.string_value = str(value)
    return a


_PACKET_TAG = 0x0A  # Trace.packet: field 1, length-delimited


def whole_packets(data: bytes) -> bytes:
    """`data` up to its last whole packet: a file cut off mid-write (a worker killed while
    writing a chunk) loses only the packet it was writing."""
    pos = 0
    while pos < len(data):
        if data[pos] != _PACKET_TAG:
            break
        size, shift, i = 0, 0, pos + 1
        while i < len(data) and data[i] & 0x80:
            size |= (data[i] & 0x7F) << shift
            shift, i = shift + 7, i + 1
        if i >= len(data):
            break
        size |= data[i] << shift
        if i + 1 + size > len(data):
            break
        pos = i + 1 + size
    return data[:pos]


def merge(paths: Iterable[Path]) -> bytes:
    """One trace of every worker's file (in the order given): what ui.perfetto.dev opens."""
    return b"".join(whole_packets(Path(p).read_bytes()) for p in paths)


def read_trace(data: bytes) -> Trace:
    """The packets of a trace file or of `merge`'s output (tests read traces with it)."""
    trace = Trace()
    trace.ParseFromString(data)
    return trace
