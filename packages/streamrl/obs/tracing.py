"""Perfetto traces, written by explicit id: spans and counters from every worker process.

A worker records a span with the ids it belongs to (`Tracer.span(track, name, start, end)`,
the track named by kind and id: `track("episode", traj_id)`), after the fact, with the
start and end it measured itself. Nothing is inferred from a per-thread or per-task stack,
so under any concurrency a span lands on the episode, call or step it names (Tunix's shared
span stack put 17 of 64 episode spans on the wrong episode at 32 concurrent ones).

Each worker streams its own file, `RUN_DIR/traces/<worker>.pftrace` (`open_tracer`): a
sequence of `TracePacket`s framed as the repeated field of a `Trace` message, written in
chunks of whole packets (every `trace.chunk_packets` packets, and at least every
`trace.flush_s` by the tracer's timer), so a crash loses at most what was not yet written and
what is on disk always parses up to its last whole packet. A worker that restarts truncates
its file to that packet before it appends (a packet cut off mid-file would hide every packet
after it). Serialized `Trace` messages concatenate into one valid `Trace`, so `merge` is a
concatenation: one process per worker (its process track), each worker's tracks under it.
`streamrl trace RUN_DIR` writes the merge (`merge_run`), which ui.perfetto.dev opens as is.

Clocks: every timestamp in a trace is on the Redis server's clock, nanoseconds since the
epoch. A tracer measures its host's offset to it once, when it opens: Redis TIME between two
readings of the local wall clock, the offset taken at the midpoint of the round trip with
the shortest of a few tries (error at most half that round trip, well under a millisecond on
one network), and adds it to every timestamp it writes. Callers hand in their own host's
`time.time_ns()`; a time that crosses processes (a tool call's enqueue time, read by the
tools worker) travels on the Redis clock (`Tracer.shared_ns`) and is taken back with
`Tracer.local_ns`. Spans of processes on different hosts then line up on one timeline
whether or not the hosts' clocks agree (drift after the measurement is not corrected).

Flow arrows (an episode to its group, a group to the train step that used it) link spans
by `flow_id(kind, key)`: the same id from both ends, in any process.

Cost: the perfetto package's protobuf classes take about ten microseconds to build and
serialize a span's two packets, so the writer encodes packets by hand (the protobuf wire
format; a test checks them against the classes). A span with a real timestamp and no
arguments, the common case, is only appended to a batch (about a microsecond with the
lock); at each flush the batch is encoded at once with numpy, one packet layout per span
name and flow count filled in by columns (a timestamp's varint is always 9 bytes, a track
uuid's 10: ids have their top bit set). Track descriptors, counters and spans with
arguments are encoded one by one. An episode of two turns (7 spans and its track) costs
the rollout worker about 15-30 us of CPU (ops/bench/tracing.py).
"""

from __future__ import annotations

import atexit
import os
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol, TypedDict

import numpy as np
import xxhash
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import (
    DebugAnnotation,
    ProcessDescriptor,
    Trace,
    TracePacket,
    TrackDescriptor,
    TrackEvent,
)

from streamrl.config import TraceConfig
from streamrl.names import RunPaths

# TracePacket.sequence_flags: the first packet of a writer's sequence starts it afresh.
_SEQ_INCREMENTAL_STATE_CLEARED = 1
TRACES_DIR = RunPaths.TRACES  # under the run directory: one <worker>.pftrace per worker
TRACE_SUFFIX = ".pftrace"
MAX_TRACKS = 1 << 16  # track descriptors remembered; a forgotten one is written again

Arg = str | int | float | bool
_TOP_BIT = 1 << 63


class Span:
    """The span names every worker writes (the report groups them by these names)."""

    EPISODE = "episode"  # one per episode, on track ("episode", traj_id)
    MODEL_QUEUE = "model.queue"  # a model call waiting for the engine to take it
    MODEL_DECODE = "model.decode"  # ... and from then to its result
    TOOL_WAIT = "tool.wait"  # rollout: a tool call from its enqueue to its result
    TOOL_ENQUEUE = "tool.enqueue"  # rollout: one attempt's enqueue on rq
    TOOL_QUEUE = "tool.queue"  # tools worker: the call waiting in the queue
    TOOL_EXEC = "tool.exec"  # tools worker: the call run (sandbox, ledger)
    ENV_STEP = "env.step"  # one environment step of an episode
    ROLLOUT_INPUT_WAIT = "rollout.input_wait"  # rollout waiting for tasks
    WEIGHTS_LOCK_WAIT = "weights.lock_wait"  # rollout waiting on the weight-sync lock
    WEIGHTS_LOAD = "weights.load"  # rollout: a published version loaded and swapped in
    WEIGHTS_PUBLISH = "weights.publish"  # trainer: a version published
    GROUP_WAIT = "group.wait"  # grouper: first member arrived .. group emitted
    TRAINER_BATCH_WAIT = "trainer.batch_wait"  # trainer waiting for a step's groups
    TRAIN_STEP = "train.step"
    CHECKPOINT_SNAPSHOT = "checkpoint.snapshot"  # the queues' snapshot at the cut
    CHECKPOINT_SAVE = "checkpoint.save"  # the Orbax save of the state
    CHECKPOINT_COMMIT = "checkpoint.commit"  # meta, marker, the groups acknowledged
    WORKER_START = "worker.start"  # trace open .. the main loop's first turn (model, warm start)

    ALL = (
        EPISODE,
        MODEL_QUEUE,
        MODEL_DECODE,
        TOOL_WAIT,
        TOOL_ENQUEUE,
        TOOL_QUEUE,
        TOOL_EXEC,
        ENV_STEP,
        ROLLOUT_INPUT_WAIT,
        WEIGHTS_LOCK_WAIT,
        WEIGHTS_LOAD,
        WEIGHTS_PUBLISH,
        GROUP_WAIT,
        TRAINER_BATCH_WAIT,
        TRAIN_STEP,
        CHECKPOINT_SNAPSHOT,
        CHECKPOINT_SAVE,
        CHECKPOINT_COMMIT,
        WORKER_START,
    )


# Flow kinds: flow_id(TRAJ_FLOW, traj_id) from the episode to its group.wait,
# flow_id(GROUP_FLOW, group_id) from group.wait to the train.step that used the group.
TRAJ_FLOW = "traj"
GROUP_FLOW = "group"


def _id64(text: str) -> int:
    """A stable 64-bit id (track uuids and flow ids must agree across processes). Its top
    bit is set, so its varint is always 10 bytes (what the batched encoding lays out)."""
    return xxhash.xxh64_intdigest(text.encode()) | _TOP_BIT


def flow_id(kind: str, key: str) -> int:
    """The flow id that links the spans of one thing (`kind` "group", `key` its id)."""
    return _id64(f"flow/{kind}/{key}")


# -- hand encoding of the hot packets (protobuf wire format) --------------------------------
# TracePacket: timestamp 8 (varint), trusted_packet_sequence_id 10 (varint), track_event 11.
# TrackEvent: type 9, track_uuid 11, name 23, flow_ids 47 and terminating_flow_ids 48
# (fixed64), debug_annotations 4, double_counter_value 44 (double).
_PACKET = b"\x0a"  # Trace.packet: field 1, length-delimited
_TIMESTAMP = b"\x40"
_SEQUENCE = b"\x50"
_TRACK_EVENT = b"\x5a"
_TRACK_UUID = b"\x58"
_NAME = b"\xba\x01"
_FLOW = b"\xf9\x02"
_END_FLOW = b"\x81\x03"
_ANNOTATION = b"\x22"
_DOUBLE_VALUE = b"\xe1\x02"
_SLICE_BEGIN = b"\x48\x01"
_SLICE_END = b"\x48\x02"
_COUNTER = b"\x48\x04"
# TracePacket.track_descriptor 60; TrackDescriptor: uuid 1, name 2, parent_uuid 5, counter 8.
_TRACK_DESCRIPTOR = b"\xe2\x03"
_DESC_UUID = b"\x08"
_DESC_NAME = b"\x12"
_DESC_PARENT = b"\x28"
_DESC_COUNTER = b"\x42\x00"  # an empty CounterDescriptor: a counter track
_U64 = struct.Struct("<Q")
_FAST_TIME = 1 << 56  # a timestamp from here on (1972) has a 9-byte varint
_F64 = struct.Struct("<d")


def _varint(v: int) -> bytes:
    if v < 0x80:
        return bytes((v,))
    if v >= _TOP_BIT:  # an id: 10 bytes
        return bytes(
            (
                v & 0x7F | 0x80,
                v >> 7 & 0x7F | 0x80,
                v >> 14 & 0x7F | 0x80,
                v >> 21 & 0x7F | 0x80,
                v >> 28 & 0x7F | 0x80,
                v >> 35 & 0x7F | 0x80,
                v >> 42 & 0x7F | 0x80,
                v >> 49 & 0x7F | 0x80,
                v >> 56 & 0x7F | 0x80,
                v >> 63,
            )
        )
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _size(data: bytes) -> bytes:
    """The varint of `data`'s length."""
    n = len(data)
    return bytes((n,)) if n < 0x80 else _varint(n)


def _framed(tag: bytes, body: bytes) -> bytes:
    return tag + _varint(len(body)) + body


class _Columns(TypedDict):
    """Where a span's values go in its packet pair (`TraceWriter._layout`): the start and
    end timestamps, the track uuid in each packet, and each flow id."""

    start: int
    uuid: int
    flows: list[int]
    end: int
    end_uuid: int


class TraceWriter:
    """One worker's trace file. Not thread-safe: `Tracer` puts a lock around it.

    Timestamps are written as given (nanoseconds) plus `offset_ns`. `chunk_packets`:
    packets held before they are written in one write (and flushed). A file already there
    (a restarted worker's) is cut to its last whole packet, then appended to."""

    def __init__(
        self, path: Path, worker: str, pid: int, chunk_packets: int = 256, max_bytes: int = 0
    ) -> None:
        if chunk_packets < 1:
            raise ValueError(f"chunk_packets must be >= 1, got {chunk_packets}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.worker = worker
        self.chunk_packets = chunk_packets
        self.cut_bytes = truncate_to_whole(path)  # what a crash left of a packet, dropped
        self.offset_ns = 0  # added to every timestamp (Tracer: this host's clock to Redis's)
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 (closed in close())
        self._pending: list[bytes] = []
        self._held = 0  # packets in _pending
        # tracks whose descriptor is written -> that descriptor's packet (written again at
        # the top of a file the writer rolls over to)
        self._described: dict[int, bytes] = {}
        self.max_bytes = max_bytes  # past it, the file rolls over (0: never)
        self.rollovers = 0
        # uuid -> (its track_uuid field, the tail of its slice-end packets after the time)
        self._tracks: dict[int, tuple[bytes, bytes]] = {}
        self._names: dict[str, bytes] = {}  # span name -> its encoded name field
        # (name, flows, ended flows) -> the spans batched, and the packet layout of such spans
        self._batched: dict[tuple[str, int, int], list[tuple[int, ...]]] = {}
        self._layouts: dict[tuple[str, int, int], tuple[bytes, _Columns]] = {}
        self._high, self._high_bytes = -1, b""  # the last timestamp's bits above 28
        self._sequence_id = _id64(f"sequence/{worker}/{pid}") & 0xFFFFFFFF or 1
        self._sequence = _SEQUENCE + _varint(self._sequence_id)
        self.process_track = _id64(f"process/{worker}/{pid}")
        self._parent = _DESC_PARENT + _varint(self.process_track)
        desc = TrackDescriptor(
            uuid=self.process_track, process=ProcessDescriptor(pid=pid, process_name=worker)
        )
        first = TracePacket(track_descriptor=desc)
        first.sequence_flags = _SEQ_INCREMENTAL_STATE_CLEARED
        first.trusted_packet_sequence_id = self._sequence_id
        self._first = _framed(_PACKET, first.SerializeToString())
        self._add(self._first, 1)

    def _add(self, data: bytes, packets: int) -> None:
        self._pending.append(data)
        self._held += packets
        if self._held >= self.chunk_packets:
            self.flush()

    def _track(self, uuid: int) -> tuple[bytes, bytes]:
        known = self._tracks.get(uuid)
        if known is None:  # a uuid this writer did not make (or forgot): no descriptor
            known = self._remember(uuid)
        return known

    def _remember(self, uuid: int) -> tuple[bytes, bytes]:
        if len(self._tracks) >= MAX_TRACKS:  # bounded
            self._tracks.clear()
        field = _TRACK_UUID + _varint(uuid)
        known = self._tracks[uuid] = (
            field,
            _framed(_TRACK_EVENT, _SLICE_END + field) + self._sequence,
        )
        return known

    def _describe(self, uuid: int, name: str, extra: bytes = b"") -> None:
        """The descriptor of track `uuid` under this process (hand-encoded, like spans)."""
        if len(self._described) >= MAX_TRACKS:  # bounded: a track seen again is described again
            self._described.clear()
        text = name.encode()
        desc = _DESC_UUID + _varint(uuid) + self._parent + _DESC_NAME + _size(text) + text + extra
        packet = _TRACK_DESCRIPTOR + _size(desc) + desc + self._sequence
        self._described[uuid] = framed = _PACKET + _size(packet) + packet
        self._add(framed, 1)

    def track(self, kind: str, key: str) -> int:
        """The uuid of the track of `kind` `key` (an episode, a tool call, a step) under this
        worker's process; its descriptor is written the first time."""
        uuid = _id64(f"track/{self.worker}/{kind}/{key}")
        if uuid not in self._described:
            self._describe(uuid, f"{kind} {key}")
        return uuid

    def span(
        self,
        track: int,
        name: str,
        start_ns: int,
        end_ns: int,
        flows: Sequence[int] = (),
        ends_flows: Sequence[int] = (),
        args: Mapping[str, Arg] | None = None,
    ) -> None:
        """A slice from `start_ns` to `end_ns` (plus `offset_ns`) on `track`; `flows` start
        or continue flow arrows from it, `ends_flows` end them there."""
        if end_ns < start_ns or start_ns + self.offset_ns < 0:
            raise ValueError(f"span {name!r} ends ({end_ns}) before it starts ({start_ns})")
        if start_ns >= _FAST_TIME and end_ns < _TOP_BIT and track >= _TOP_BIT and not args:
            # The common case, batched: encoded at the flush, many spans at once (_encode).
            key = (name, len(flows), len(ends_flows))
            rows = self._batched.get(key)
            if rows is None:
                rows = self._batched[key] = []
            rows.append((track, start_ns, end_ns, *flows, *ends_flows))
            self._held += 2
            if self._held >= self.chunk_packets:
                self.flush()
            return
        start_ns, end_ns = start_ns + self.offset_ns, end_ns + self.offset_ns
        field, end_tail = self._tracks.get(track) or self._remember(track)
        ev = _SLICE_BEGIN + field + (self._names.get(name) or self._name(name))
        if flows or ends_flows or args:
            ev += _extras(flows, ends_flows, args)
        n = len(ev)
        begin_tail = _TRACK_EVENT + (bytes((n,)) if n < 0x80 else _varint(n)) + ev + self._sequence
        t0, t1 = self._time(start_ns), self._time(end_ns)
        self._pending.append(
            _PACKET
            + _varint(1 + len(t0) + len(begin_tail))
            + _TIMESTAMP
            + t0
            + begin_tail
            + _PACKET
            + _varint(1 + len(t1) + len(end_tail))
            + _TIMESTAMP
            + t1
            + end_tail
        )
        self._held += 2
        if self._held >= self.chunk_packets:
            self.flush()

    def _time(self, ns: int) -> bytes:
        """The varint of a timestamp: its bits above the lowest 28 change every 0.27 s, so
        their bytes are kept (nanoseconds since 1970 take 9 bytes until 2262)."""
        if ns < 1 << 28:
            return _varint(ns)
        high = ns >> 28
        if high != self._high:
            self._high, self._high_bytes = high, _varint(high)
        return (
            bytes(
                (
                    ns & 0x7F | 0x80,
                    ns >> 7 & 0x7F | 0x80,
                    ns >> 14 & 0x7F | 0x80,
                    ns >> 21 & 0x7F | 0x80,
                )
            )
            + self._high_bytes
        )

    def _name(self, name: str) -> bytes:
        field = self._names[name] = _framed(_NAME, name.encode())
        return field

    def counter(self, name: str, value: float, ts_ns: int) -> None:
        """One sample of the counter `name` (its track is made the first time)."""
        uuid = _id64(f"counter/{self.worker}/{name}")
        if uuid not in self._described:
            self._describe(uuid, name, _DESC_COUNTER)
        field, _ = self._tracks.get(uuid) or self._remember(uuid)
        ev = _COUNTER + field + _DOUBLE_VALUE + _F64.pack(float(value))
        ts_ns += self.offset_ns
        packet = _TIMESTAMP + _varint(ts_ns) + _framed(_TRACK_EVENT, ev) + self._sequence
        self._add(_framed(_PACKET, packet), 1)

    def flush(self) -> None:
        """Write the packets held, as one chunk of whole packets: those encoded one by one
        (descriptors among them) first, then the batched spans."""
        if not self._held:
            return
        parts = [b"".join(self._pending)]
        parts += [self._encode(*key, rows) for key, rows in self._batched.items() if rows]
        self._pending.clear()
        self._batched.clear()
        self._held = 0
        self._file.write(b"".join(parts))
        self._file.flush()
        if self.max_bytes and self._file.tell() > self.max_bytes:
            self._roll_over()

    def _roll_over(self) -> None:
        """Review part 3: a worker's trace grew without bound (about 1 KB an episode). Past
        `max_bytes` the file becomes `<worker>.1.pftrace` (the one before it goes) and a new
        one starts, with the process's and every known track's descriptor again, so each
        file reads on its own and `streamrl trace` merges both."""
        self._file.close()
        os.replace(self.path, self.path.with_name(f"{self.worker}.1{TRACE_SUFFIX}"))
        self._file = open(self.path, "ab")  # noqa: SIM115 (closed in close())
        self._file.write(self._first + b"".join(self._described.values()))
        self._file.flush()
        self.rollovers += 1

    def _encode(self, name: str, flows: int, ends: int, rows: list[tuple[int, ...]]) -> bytes:
        """The packets of `rows` (track, start, end, flow ids..., ended flow ids...), spans
        `name` with that many flows: one layout for them all (a timestamp's varint is 9
        bytes, a uuid's 10), so numpy fills a row per span of a template, by columns."""
        template, at = self._layout(name, flows, ends)
        values = np.array(rows, dtype=np.uint64)
        out = np.empty((len(rows), len(template)), np.uint8)
        out[:] = np.frombuffer(template, np.uint8)
        shifted = (values[:, 1:3].astype(np.int64) + self.offset_ns).astype(np.uint64)
        times = _varints(shifted, 9)  # [k, 2, 9]
        out[:, at["start"] : at["start"] + 9] = times[:, 0]
        out[:, at["end"] : at["end"] + 9] = times[:, 1]
        uuids = _varints(values[:, 0:1], 10)[:, 0]
        out[:, at["uuid"] : at["uuid"] + 10] = uuids
        out[:, at["end_uuid"] : at["end_uuid"] + 10] = uuids
        if at["flows"]:
            ids = values[:, 3:].astype("<u8").view(np.uint8).reshape(len(rows), -1, 8)
            for i, col in enumerate(at["flows"]):
                out[:, col : col + 8] = ids[:, i]
        return out.tobytes()

    def _layout(self, name: str, flows: int, ends: int) -> tuple[bytes, _Columns]:
        """The packet pair of a span `name` with `flows` and `ends` flow ids, zeros where
        the values go, and the columns they go at."""
        key = (name, flows, ends)
        known = self._layouts.get(key)
        if known is not None:
            return known
        zero_ts, zero_uuid, zero_flow = b"\x80" * 8 + b"\x01", b"\x80" * 9 + b"\x01", bytes(8)
        ev = _SLICE_BEGIN + _TRACK_UUID
        uuid_at = len(ev)
        ev += zero_uuid + _framed(_NAME, name.encode())
        flow_at = []
        for tag in [_FLOW] * flows + [_END_FLOW] * ends:
            ev += tag
            flow_at.append(len(ev))
            ev += zero_flow
        body = _TIMESTAMP + zero_ts + _TRACK_EVENT + _varint(len(ev))
        head = _PACKET + _varint(len(body) + len(ev) + len(self._sequence))
        begin = head + body + ev + self._sequence
        ev_at = len(head) + len(body)
        end_ev = _SLICE_END + _TRACK_UUID + zero_uuid
        end_body = _TIMESTAMP + zero_ts + _framed(_TRACK_EVENT, end_ev) + self._sequence
        end_head = _PACKET + _varint(len(end_body))
        at: _Columns = {
            "start": len(head) + 1,
            "uuid": ev_at + uuid_at,
            "flows": [ev_at + f for f in flow_at],
            "end": len(begin) + len(end_head) + 1,
            "end_uuid": len(begin) + len(end_head) + len(_TIMESTAMP + zero_ts) + 2 + 3,
        }
        known = self._layouts[key] = (begin + end_head + end_body, at)
        return known

    def close(self) -> None:
        self.flush()
        self._file.close()


def _varints(values: np.ndarray, width: int) -> np.ndarray:
    """`values` [k, n] (uint64) as varints of exactly `width` bytes each, [k, n, width]
    uint8 (each value needs that many: its top 7-bit group is nonzero)."""
    shifts = np.arange(0, 7 * width, 7, dtype=np.uint64)
    groups = (values[:, :, None] >> shifts) & np.uint64(0x7F)
    groups[:, :, :-1] |= np.uint64(0x80)
    return groups.astype(np.uint8)


def _extras(
    flows: Sequence[int], ends_flows: Sequence[int], args: Mapping[str, Arg] | None
) -> bytes:
    """A slice-begin event's flow ids and debug annotations."""
    out = b"".join(_FLOW + _U64.pack(f) for f in flows)
    out += b"".join(_END_FLOW + _U64.pack(f) for f in ends_flows)
    if args:
        out += b"".join(
            _framed(_ANNOTATION, _annotation(k, v).SerializeToString()) for k, v in args.items()
        )
    return out


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


# -- the thread-safe tracer of a worker process ---------------------------------------------


class Tracer:
    """A worker process's tracer: a lock around its `TraceWriter`, a timer that writes what
    is held at least every `flush_s`, and the offset of this host's clock to the Redis
    server's, added to every timestamp (module docstring). `Tracer.disabled()` (or a closed
    one) records nothing, at the cost of a method call.

    Times given are this host's `time.time_ns()`. Closed at exit if not before."""

    def __init__(self, writer: TraceWriter | None, offset_ns: int = 0, flush_s: float = 1.0):
        self._writer = writer
        self.offset_ns = offset_ns
        if writer is not None:
            writer.offset_ns = offset_ns
        self.flush_s = flush_s
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._timer: threading.Thread | None = None
        if writer is not None:
            self._timer = threading.Thread(
                target=self._flush_every, name="trace-flush", daemon=True
            )
            self._timer.start()
            atexit.register(self.close)

    @classmethod
    def disabled(cls) -> Tracer:
        return cls(None)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    @property
    def path(self) -> Path | None:
        return self._writer.path if self._writer is not None else None

    def shared_ns(self, local_ns: int) -> int:
        """`local_ns` on the Redis clock: how a time travels to another process."""
        return local_ns + self.offset_ns

    def local_ns(self, shared_ns: int) -> int:
        """A Redis-clock time (another process's `shared_ns`, a Redis TIME) on this host's."""
        return shared_ns - self.offset_ns

    def track(self, kind: str, key: str) -> int:
        """The uuid of the track of `kind` `key` under this process (0 when disabled)."""
        if self._writer is None:
            return 0
        with self._lock:
            if self._writer is None:
                return 0
            return self._writer.track(kind, key)

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
        """A slice `name` on `track` from `start_ns` to `end_ns` (this host's clock)."""
        if self._writer is None:
            return
        with self._lock:
            writer = self._writer
            if writer is not None:  # (closed meanwhile)
                writer.span(track, name, start_ns, end_ns, flows, ends_flows, args)

    def counter(self, name: str, value: float, ts_ns: int) -> None:
        """One sample of the counter `name` at `ts_ns` (the metrics sampler's sink)."""
        if self._writer is None:
            return
        with self._lock:
            if self._writer is not None:
                self._writer.counter(name, value, ts_ns)

    def flush(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.flush()

    def close(self) -> None:
        """Write what is held and close the file; later calls record nothing."""
        self._closed.set()
        with self._lock:
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.close()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(timeout=5)
            atexit.unregister(self.close)

    def _flush_every(self) -> None:
        while not self._closed.wait(self.flush_s):
            self.flush()


class ServerClock(Protocol):
    """What the clock offset needs of a Redis client: TIME, as (seconds, microseconds), or
    per node from a cluster client."""

    def time(self) -> tuple[int, int] | dict[str, tuple[int, int]]: ...


def server_time_ns(client: ServerClock) -> int:
    """The Redis server's clock now, ns (TIME; a cluster client answers per node: any one
    will do)."""
    raw = client.time()
    if isinstance(raw, dict):
        raw = next(iter(raw.values()))
    sec, usec = raw
    return int(sec) * 1_000_000_000 + int(usec) * 1000


def clock_offset_ns(client: ServerClock, tries: int = 5) -> tuple[int, int]:
    """(offset, round trip), ns: the Redis server's clock minus this host's wall clock,
    taken at the midpoint of the shortest of `tries` TIME round trips."""
    best: tuple[int, int] | None = None
    for _ in range(tries):
        t0 = time.time_ns()
        server = server_time_ns(client)
        t1 = time.time_ns()
        offset, rtt = server - (t0 + t1) // 2, t1 - t0
        if best is None or rtt < best[1]:
            best = (offset, rtt)
    assert best is not None
    return best


def trace_path(run_dir: Path, worker_id: str) -> Path:
    return run_dir / TRACES_DIR / f"{worker_id}{TRACE_SUFFIX}"


def open_tracer(cfg: TraceConfig, run_dir: Path, worker_id: str, client: ServerClock) -> Tracer:
    """The tracer of worker `worker_id`, writing `RUN_DIR/traces/<worker_id>.pftrace`, its
    clock offset measured against `client`'s server; disabled unless `cfg.enabled`."""
    if not cfg.enabled:
        return Tracer.disabled()
    offset, _rtt = clock_offset_ns(client)
    max_bytes = int(cfg.max_mb * 2**20)
    path = trace_path(run_dir, worker_id)
    writer = TraceWriter(path, worker_id, os.getpid(), cfg.chunk_packets, max_bytes)
    return Tracer(writer, offset, cfg.flush_s)


# -- reading and merging ----------------------------------------------------------------------

_PACKET_TAG = 0x0A  # Trace.packet: field 1, length-delimited


def _whole_end(data: bytes | memoryview, pos: int = 0) -> int:
    """The end of the last whole packet of `data` from `pos` on."""
    n = len(data)
    while pos < n:
        if data[pos] != _PACKET_TAG:
            break
        size, shift, i = 0, 0, pos + 1
        while i < n and data[i] & 0x80:
            size |= (data[i] & 0x7F) << shift
            shift, i = shift + 7, i + 1
        if i >= n:
            break
        size |= data[i] << shift
        if i + 1 + size > n:
            break
        pos = i + 1 + size
    return pos


def whole_packets(data: bytes) -> bytes:
    """`data` up to its last whole packet: a file cut off mid-write (a worker killed while
    writing a chunk) loses only the packet it was writing."""
    return data[: _whole_end(data)]


def whole_size(path: Path, block: int = 1 << 20) -> int:
    """The bytes of the file at `path` up to its last whole packet, read a block at a time."""
    end = 0
    with open(path, "rb") as f:
        tail = b""
        while chunk := f.read(block):
            tail += chunk
            used = _whole_end(tail)
            end += used
            tail = tail[used:]
            if tail and tail[0] != _PACKET_TAG:
                break  # not a packet: the file stops making sense here
    return end


def truncate_to_whole(path: Path) -> int:
    """Cut the file at `path`, if there is one, to its last whole packet; the bytes cut."""
    if not path.exists():
        return 0
    size = path.stat().st_size
    whole = whole_size(path)
    if whole < size:
        os.truncate(path, whole)
    return size - whole


def merge(paths: Iterable[Path]) -> bytes:
    """One trace of every worker's file (in the order given): what ui.perfetto.dev opens."""
    return b"".join(whole_packets(Path(p).read_bytes()) for p in paths)


def read_trace(data: bytes) -> Trace:
    """The packets of a trace file or of `merge`'s output (tests read traces with it)."""
    trace = Trace()
    trace.ParseFromString(data)
    return trace


def trace_files(run_dir: Path) -> list[Path]:
    """The run's worker trace files, by name."""
    return sorted((run_dir / TRACES_DIR).glob(f"*{TRACE_SUFFIX}"))


@dataclass(frozen=True)
class Tracks:
    """What a trace's track descriptors name, by track uuid: each process track's (pid,
    process name), each track's parent track, each counter track's counter name."""

    process: dict[int, tuple[int, str]]
    parent: dict[int, int]
    counter: dict[int, str]


def tracks_of(trace: Trace) -> Tracks:
    """The track descriptors of `trace` (the summary below and the report read them)."""
    names = Tracks({}, {}, {})
    for p in trace.packet:
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            if d.HasField("process"):
                names.process[d.uuid] = (d.process.pid, d.process.process_name)
            if d.parent_uuid:
                names.parent[d.uuid] = d.parent_uuid
            if d.HasField("counter"):
                names.counter[d.uuid] = d.name
    return names


@dataclass
class TraceSummary:
    """What a trace holds: its processes (pid, name), spans per name, counter samples per
    counter name, flows started and ended."""

    processes: list[tuple[int, str]] = field(default_factory=list)
    spans: Counter[str] = field(default_factory=Counter)
    counters: Counter[str] = field(default_factory=Counter)
    flows: int = 0
    flows_ended: int = 0

    def add(self, trace: Trace) -> None:
        names = tracks_of(trace)
        # a file a writer rolled over to names its process again
        self.processes += [q for q in names.process.values() if q not in self.processes]
        for p in trace.packet:
            if p.HasField("track_event"):
                e = p.track_event
                if e.type == TrackEvent.TYPE_SLICE_BEGIN:
                    self.spans[e.name] += 1
                    self.flows += len(e.flow_ids)
                    self.flows_ended += len(e.terminating_flow_ids)
                elif e.type == TrackEvent.TYPE_COUNTER:
                    self.counters[names.counter.get(e.track_uuid, "?")] += 1


def merge_run(run_dir: Path, out: Path) -> TraceSummary:
    """Merge the run's worker files (`trace_files`) into `out`, a file at a time (a file
    read up to its last whole packet); what the merged trace holds."""
    summary = TraceSummary()
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "wb") as f:
        for path in trace_files(run_dir):
            if path.resolve() == out.resolve():
                continue
            data = whole_packets(path.read_bytes())
            summary.add(read_trace(data))
            f.write(data)
    os.replace(tmp, out)
    return summary
