"""The rollout worker's loop: read tasks, run their members' episodes (all
`num_generations`, or the members a re-run task names), emit trajectories, acknowledge a
task only with the write of its last trajectory.

Up to `max_concurrency` episodes run at once on one event loop, in four parts that never
wait for each other's Redis round trips:

- the reader takes as many tasks as the free slots hold (plus one task read ahead) in one
  XREADGROUP, unless rollout is backpressured (too many groups wait for the trainer or are
  half filled; read before each batch) or a weight sync holds the follower's lock; in
  `rollout.mode = "sync"`, no more than the batch of the version served allows
  (`SyncBatches`);
- the starter starts waiting members as slots free, one at a time if need be: a task's
  members need not start together (those that do share their prompt's prefill);
- each episode, when it ends, puts its trajectory in the outbox;
- the committer writes everything in the outbox in one MULTI/EXEC, with the
  acknowledgement of each task whose last member is in it (so a crash loses no task: an
  unacknowledged one is claimed and run again).

Traced (`tracer`): the reader's reads that waited (`rollout.input_wait`, on track
("rollout", "reader")), and the reader's and starter's waits on the weight-sync lock
(`weights.lock_wait`, on tracks ("rollout", "reader") and ("rollout", "starter")); each
episode traces itself (`EpisodeRunner`).

Entries still being worked on are touched regularly, so a long episode is not mistaken for
the work of a dead consumer and claimed by another worker; a task another worker claimed
anyway is not taken back, and this worker's own entry claimed again is not run twice.

With `rollout.resume_episodes`, each episode's state at every turn boundary goes into the
committer's next transaction (`Keys.episodes`); a committed member's state becomes a
"committed" marker in the transaction of its trajectory, and the ack of its task deletes
its members' entries. A task claimed from another worker (or delivered again after the
queues were restored) runs only its members without that marker, each from its saved
state when it has one.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import redis
import redis.asyncio as aioredis
import structlog
from redis.typing import EncodableT, FieldT

from streamrl import counters
from streamrl.agents.base import Agent, Environment
from streamrl.capacity import ADVERTISE_SCRIPT
from streamrl.config import Config
from streamrl.names import Keys
from streamrl.obs.metrics import (
    ACTIVE_EPISODES,
    POLICY_AGE,
    POLICY_VERSION,
    REWARD,
    SOLVED,
    SOLVED_REWARD,
    TRAJECTORIES,
    Metrics,
)
from streamrl.obs.tracing import Span, Tracer
from streamrl.rollout.admission import TICK_S, Admission
from streamrl.rollout.episode import ModelServer, Runner, traj_id
from streamrl.rollout.threads import WorkerThreads
from streamrl.rollout.weights import WeightFollower
from streamrl.run.failpoints import EPISODE_SAVED, afailpoint
from streamrl.run.liveness import Liveness
from streamrl.run.tasks import cancel_and_wait
from streamrl.tasks.registry import Episodes
from streamrl.transport import (
    Delivery,
    Pipeline,
    RedisStreamConsumer,
    ahkeys_str,
    ahmget_bytes,
    is_cluster,
)
from streamrl.wire import EpisodeState, Task, Trajectory, WireError, decode_state, encode_state

LOG_ROWS = 32  # trajectories per `trajectories_committed` log line (a line stays ~6 KB)
# A read that brought tasks within this long did not wait for input (a round trip); one
# that took longer, or brought none, is a `rollout.input_wait` span.
INPUT_WAIT_MIN_NS = 2_000_000


class Backpressure:
    """Whether rollout may start a new task: not while `max_ready_groups` groups wait for
    the trainer (the trainer consumer group's lag, as a grouper publishes it:
    `Grouper.publish_waiting`), nor while `max_partial_groups` groups are half filled (HLEN
    of the groups-started hash). While no grouper has counted lately (every grouper down),
    the trajectories written but not yet grouped count as ready groups too. Each move into
    the paused state is counted once in stats
    (`backpressure_pauses`) and logged with its reason, as is the resume."""

    def __init__(
        self,
        aclient: aioredis.Redis,
        keys: Keys,
        cfg: Config,
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        self.aclient = aclient
        self.keys = keys
        self.cfg = cfg
        self.log = log
        self.paused_since: float | None = None  # monotonic time of the pause, None: running

    async def reason(self, ending: int = 0) -> str | None:
        """Why no task may start now, or None. `ending`: groups whose episodes this worker
        has finished but not yet committed (ready in a moment, not yet counted in Redis)."""
        rcfg = self.cfg.rollout
        pipe = self.aclient.pipeline(transaction=False)
        pipe.hlen(self.keys.groups_started)
        pipe.get(self.keys.groups_waiting)
        pipe.hmget(
            self.keys.stats,
            [
                counters.GROUPS,
                counters.GROUPS_TRAINED,
                counters.GROUPS_SET_ASIDE,
                counters.TRAJECTORIES,
                counters.TRAJECTORIES_DROPPED,
            ],
        )
        partial, waiting, counted = await pipe.execute()
        if waiting is None:  # no grouper has counted lately: the counters, roughly
            groups, trained, aside, written, dropped = (int(c or 0) for c in counted)
            # ... and the trajectories no grouper has put in a group yet (every grouper
            # down, review N11), in groups' worth: without them rollout would write on
            # into a stream nobody reads until Redis is out of memory. Re-runs and
            # released groups make this an overcount, which only pauses sooner while no
            # grouper is there to count.
            ungrouped = max(0, written - dropped - groups * rcfg.num_generations)
            waiting = groups - trained - aside + ungrouped // rcfg.num_generations
        ready = int(waiting) + ending
        if ready >= rcfg.max_ready_groups:
            return f"{ready} groups wait for the trainer (max_ready_groups {rcfg.max_ready_groups})"
        if rcfg.max_partial_groups and int(partial) >= rcfg.max_partial_groups:
            return (
                f"{partial} groups are half filled (max_partial_groups {rcfg.max_partial_groups})"
            )
        return None

    async def check(self, ending: int = 0) -> bool:
        """True while rollout must wait."""
        why = await self.reason(ending)
        if why is not None and self.paused_since is None:
            self.paused_since = time.monotonic()
            await self.aclient.hincrby(self.keys.stats, counters.BACKPRESSURE_PAUSES, 1)
            self.log.info("backpressure_paused", reason=why)
        elif why is None and self.paused_since is not None:
            paused_s = time.monotonic() - self.paused_since
            self.paused_since = None
            self.log.info("backpressure_resumed", paused_s=round(paused_s, 3))
        return why is not None


class SyncBatches:
    """`rollout.mode = "sync"`: one batch of tasks per policy version, the on-policy loop.

    A batch is the tasks this worker starts while it serves one version. It may start a
    task while `started - dropped < trainer.groups_per_step`, `dropped` being the groups of
    the batch that will never be trained: those the groupers dropped (zero variance, too
    few valid members, a timeout; `groups_dropped`) and those the trainer dead-lettered
    (`groups_set_aside` less its stale drops, already in `groups_dropped`), counted since
    the batch began. So the batch emits at most a step's worth of groups, and a dropped
    group is replaced by a new task of the same version until the trainer has its step;
    the trainer then publishes the next version, whose load begins the next batch. When
    the trainer takes its last group of the step every task of the batch has ended: no
    episode runs during the load, and every trajectory is trained by the version that
    sampled it. A re-run task (its group's missing members) belongs to a task counted
    already and is not counted again."""

    def __init__(
        self,
        aclient: aioredis.Redis,
        keys: Keys,
        cfg: Config,
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        self.aclient = aclient
        self.keys = keys
        self.size = cfg.trainer.groups_per_step
        self.log = log
        self.version = -1  # the version the batch is sampled with (-1: none yet)
        self.started = 0  # tasks started in the batch
        self.dropped_at_start = 0
        self.batches = 0

    async def _dropped(self) -> int:
        """Groups dropped or dead-lettered in the run so far (stats)."""
        raw = await ahmget_bytes(
            self.aclient,
            self.keys.stats,
            [counters.GROUPS_DROPPED, counters.GROUPS_SET_ASIDE, counters.TRAINER_GROUPS_STALE],
        )
        dropped, aside, stale = (int(v or 0) for v in raw)
        return dropped + aside - stale

    async def room(self, version: int) -> int:
        """Tasks that may start now with `version` (the one served); a new version begins
        a new batch."""
        dropped = await self._dropped()
        if version != self.version:
            if self.version >= 0:
                self.log.info(
                    "sync_batch_done",
                    version=self.version,
                    tasks=self.started,
                    dropped=dropped - self.dropped_at_start,
                )
            self.version, self.started, self.dropped_at_start = version, 0, dropped
            self.batches += 1
        return self.size - (self.started - (dropped - self.dropped_at_start))

    def count(self, deliveries: list[Delivery[Task]]) -> None:
        """Count the tasks just read (not the re-runs) as started in the batch."""
        self.started += sum(d.msg.members is None for d in deliveries)


# KEYS: the task stream. ARGV: consumer group, consumer, entry ids.
# Resets the idle time of the entries this consumer still owns (XCLAIM ... JUSTID keeps
# the delivery count) and returns those another consumer owns now: claimed while this one
# looked dead (an entry no longer pending was acknowledged: not lost). An unconditional
# XCLAIM would take
# a claimed task back, and the two workers would pass it to and fro until its delivery
# count sent it to the dead letters while both still ran it.
_TOUCH_OWN = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] ~= nil then
    if p[1][2] == ARGV[2] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    else
      table.insert(lost, ARGV[i])
    end
  end
end
return lost
"""

BACKPRESSURE_POLL_S = 0.05  # how often a paused reader reads the backpressure state again


@dataclass
class _Running:
    """A task this worker read and has not acknowledged yet."""

    unfinished: int  # members not yet ended (waiting for a slot or running)
    owned: bool = True  # False once another worker claimed it (then it is not touched)


class RolloutWorker:
    def __init__(
        self,
        *,
        client: redis.Redis,
        aclient: aioredis.Redis,
        keys: Keys,
        cfg: Config,
        consumer: str,
        server: ModelServer,
        runner: Runner,
        episodes: Episodes,
        follower: WeightFollower,
        log: structlog.stdlib.BoundLogger,
        stop: Callable[[], bool],
        threads: WorkerThreads | None = None,
        liveness: Liveness | None = None,
        metrics: Metrics | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.aclient = aclient
        self.metrics = metrics
        self.tracer = tracer or Tracer.disabled()
        self._reader_track = self.tracer.track("rollout", "reader")
        self._starter_track = self.tracer.track("rollout", "starter")
        self.liveness = liveness or Liveness()  # ticked by the supervising loop
        self._stall_logged = False  # `engine_stalled` logged for the current stall
        self.keys = keys
        self.cfg = cfg
        self.server = server
        self.runner = runner
        self.episodes = episodes
        self.follower = follower
        self.log = log
        self.stop = stop
        self.input = RedisStreamConsumer(
            client, keys, keys.tasks, keys.CG_ROLLOUT, consumer, Task, cfg.transport, log
        )
        self.backpressure = Backpressure(aclient, keys, cfg, log)
        self.sync = SyncBatches(aclient, keys, cfg, log) if cfg.rollout.mode == "sync" else None
        self._on_cluster = is_cluster(client)
        r = cfg.rollout
        self.threads = threads or WorkerThreads(r.env_threads or r.max_concurrency)
        # Episodes at once: max_concurrency, or under adaptive admission a limit that
        # follows the engine's KV pool (streamrl.rollout.admission), starting at the pool.
        self.admission = Admission(
            cap=r.max_concurrency, auto=r.admission == "auto", start=cfg.concurrency_estimate
        )
        self.paused = False  # backpressure, as the reader last read it
        self.active = 0
        # Admission figures for the stop log: episode-seconds run (the time integral of
        # `active`), reads and the tasks they brought.
        self.active_s = 0.0
        self._active_since = time.monotonic()
        self.reads = 0
        self.read_tasks = 0
        self.empty_reads = 0
        self.paused_reads = 0
        self.started = 0
        self._touch = aclient.register_script(_TOUCH_OWN)
        self._advertise = aclient.register_script(ADVERTISE_SCRIPT)
        self._changed = asyncio.Condition()  # slots freed, members queued, pause lifted
        self._tasks: dict[str, _Running] = {}  # entry id -> task read, not yet acknowledged
        # Members without a slot, each with its saved state if it has one.
        self._waiting: deque[tuple[Delivery[Task], int, EpisodeState | None]] = deque()
        self._outbox: list[tuple[Delivery[Task], Trajectory, bool]] = []
        self._states: dict[str, bytes] = {}  # trajectory id -> its latest state, unwritten
        self._bare_acks: list[Delivery[Task]] = []  # tasks whose members all committed
        self._resuming = cfg.rollout.resume_episodes
        self._saved_groups: set[str] = set()  # groups with states at start (see _look_up)
        self._outbox_ready = asyncio.Event()
        self._closing = False  # stopping: the committer drains the outbox and returns
        self._stopping = False  # the serve loop ended: start nothing more
        self._episodes: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None

    async def run(self) -> None:
        """Serve until `stop()` is true; re-raises the first failure of a component."""
        self.threads.install()
        try:
            await self._serve()
        finally:
            self.threads.close()

    async def _serve(self) -> None:
        if not await self.follower.wait_initial(self.stop):
            return
        if self._resuming:
            saved = await ahkeys_str(self.aclient, self.keys.episodes)
            self._saved_groups = {f.rpartition("-m")[0] for f in saved}
        self.log.info("rollout_ready", version=self.follower.loaded_version)
        parts = [
            asyncio.create_task(self.server.serve(), name="model-server"),
            asyncio.create_task(self.follower.follow(self.stop), name="weights"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._reader(), name="tasks"),
            asyncio.create_task(self._starter(), name="episodes"),
        ]
        if self.admission.auto:
            parts.append(asyncio.create_task(self._admitting(), name="admission"))
        committer = asyncio.create_task(self._committer(), name="commits")
        try:
            while not self.stop() and self._failure is None:
                self._tick()

                done = [p for p in [*parts, committer] if p.done()]
                for p in done:
                    p.result()  # re-raises a component's error: the process stops with it
                    raise RuntimeError(f"component {p.get_name()} stopped unexpectedly")
                await asyncio.sleep(0.1)
            if self._failure is not None:
                raise self._failure
        finally:
            self._stopping = True
            # Cancelled until they end: a cancel can be lost in a Redis call (run/tasks.py).
            await cancel_and_wait([*parts, *self._episodes])
            # Episodes that ended before the stop are committed (and logged), not run again;
            # a commit in flight is not cut off between its transaction and its log line.
            self._closing = True
            self._outbox_ready.set()
            if self._failure is not None or committer.done():
                await cancel_and_wait([committer])
            else:
                await asyncio.gather(committer, return_exceptions=True)

    # -- admission ---------------------------------------------------------------------------

    def _room(self) -> int:
        """Members to read for: free slots, plus one task's members read ahead so that a
        slot that frees starts its next episode without waiting for Redis."""
        ahead = self.cfg.rollout.num_generations
        return self.admission.limit + ahead - self.active - len(self._waiting)

    def _ended(self) -> int:
        """Tasks whose members have all ended, not yet committed: groups ready in a moment
        that Redis does not count yet (backpressure counts them)."""
        return sum(r.unfinished == 0 for r in self._tasks.values())

    def _starting(self) -> bool:
        """Whether new work may start: not once stopped, stopping or a component failed
        (after a tripped breaker, say, a new wave of episodes would only keep the engine
        busy past the worker's stop). Checked by the reader and the starter themselves:
        cancelling them is not all it takes to stop them."""
        return not (self.stop() or self._stopping or self._failure is not None)

    async def _reader(self) -> None:
        """Read as many tasks as the free slots take, in one XREADGROUP, while rollout is
        neither backpressured nor held by a weight sync. Backpressure is read (on the async
        client, no thread) before each read: one round trip per batch of tasks, and the
        bound stays as tight as when each task was checked alone."""
        n = self.cfg.rollout.num_generations
        while self._starting():
            async with self._changed:
                await self._changed.wait_for(lambda: self._room() > 0)
            self.paused = await self.backpressure.check(self._ended())
            if self.paused:
                self.paused_reads += 1
                await asyncio.sleep(BACKPRESSURE_POLL_S)
                continue
            await self.follower.lock.wait_open(self._reader_track)
            if not self._starting():
                return
            count = -(-self._room() // n)  # whole tasks, rounded up
            if self.sync is not None:
                count = min(count, await self.sync.room(self.follower.loaded_version))
                # The batch is out (wait for the trainer's next version), or a version
                # loads (its batch begins once it is served).
                if count <= 0 or not self.follower.lock.is_open:
                    await asyncio.sleep(BACKPRESSURE_POLL_S)
                    continue
            read_ns = time.time_ns()
            deliveries = await self._read(count)
            if self.sync is not None:
                self.sync.count(deliveries)
            read_end = time.time_ns()
            if not deliveries or read_end - read_ns >= INPUT_WAIT_MIN_NS:
                self.tracer.span(self._reader_track, Span.ROLLOUT_INPUT_WAIT, read_ns, read_end)
            self.reads += 1
            self.read_tasks += len(deliveries)
            self.empty_reads += not deliveries
            states = await self._look_up(deliveries)
            for d in deliveries:
                self._admit(d, states)
            if deliveries:
                async with self._changed:
                    self._changed.notify_all()

    async def _read(self, count: int) -> list[Delivery[Task]]:
        """Up to `count` tasks: on the asyncio client (no thread, no GIL hand-offs), or on a
        Redis thread against a cluster (whose asyncio pipelines are not transactions)."""
        if self._on_cluster:
            return await self.threads.redis_call(self.input.read, count)
        return await self.input.aread(self.aclient, count)

    async def _look_up(self, deliveries: list[Delivery[Task]]) -> dict[str, EpisodeState]:
        """The saved states of the members of tasks that may have some, in one HMGET: a
        task delivered before (claimed), a re-run, or one of a group that had states when
        this worker started (delivered again after the queues were restored). A new task
        has none: no round trip for it."""
        if not self._resuming:
            return {}
        tids = [
            traj_id(d.msg, m)
            for d in deliveries
            if d.deliveries > 1 or d.msg.members is not None or d.msg.group_id in self._saved_groups
            for m in d.msg.member_indices()
        ]
        if not tids:
            return {}
        raw = await ahmget_bytes(self.aclient, self.keys.episodes, tids)
        out: dict[str, EpisodeState] = {}
        for tid, data in zip(tids, raw, strict=True):
            if data is None:
                continue
            try:
                out[tid] = decode_state(data)
            except WireError as err:  # the member starts over; its state is overwritten
                self.log.warning("episode_state_unusable", traj_id=tid, error=str(err))
        return out

    def _admit(self, d: Delivery[Task], states: dict[str, EpisodeState]) -> None:
        """Queue the task's members: every member, or those a re-run task names, less those
        already committed; each with its saved state, if any."""
        if d.entry_id in self._tasks:
            # This worker's own entry, claimed back after a late heartbeat: it is running.
            self.log.warning("own_task_claimed_again", entry_id=d.entry_id)
            return
        members = []
        for m in d.msg.member_indices():
            state = states.get(traj_id(d.msg, m))
            if state is not None and state.committed:
                self.log.info("member_already_committed", traj_id=state.traj_id)
                continue
            members.append((d, m, state))
        if not members:  # all committed before their task's ack was: acknowledge it now
            self._bare_acks.append(d)
            self._outbox_ready.set()
            return
        self._tasks[d.entry_id] = _Running(len(members))
        self._waiting.extend(members)

    async def _starter(self) -> None:
        """Start waiting members as slots free (not only when a whole group fits)."""
        while self._starting():
            async with self._changed:
                await self._changed.wait_for(
                    lambda: bool(self._waiting) and self.active < self.admission.limit
                )
            # no await between this and `enter`
            await self.follower.lock.wait_open(self._starter_track)
            self._start_waiting()

    def _start_waiting(self) -> None:
        while self._waiting and self.active < self.admission.limit and self._starting():
            d, member, state = self._waiting.popleft()
            self.follower.lock.enter()
            self._count_active(+1)
            self.started += 1
            ep = asyncio.create_task(
                self._episode(d, member, state), name=f"{d.msg.group_id}-m{member}"
            )
            self._episodes.add(ep)
            ep.add_done_callback(self._episode_done)

    async def _admitting(self) -> None:
        """Adaptive admission: one look at the engine every TICK_S; a grown limit wakes the
        reader and the starter, a trim is counted, logged and traced (the limit's track)."""
        self.tracer.counter("admission_limit", self.admission.limit, time.time_ns())
        ceiling = self.admission.ceiling
        while not self._stopping:
            await asyncio.sleep(TICK_S)
            before = self.admission.limit
            occupancy = self.server.occupancy()
            action = self.admission.update(self.active, len(self._waiting), occupancy)
            if action == "grow":
                async with self._changed:
                    self._changed.notify_all()
            elif action == "trim":
                await self.aclient.hincrby(self.keys.stats, counters.ADMISSION_TRIMS, 1)
                self.log.info(
                    "admission_trimmed",
                    limit=self.admission.limit,
                    was=before,
                    running=self.active,
                    pressure=None if occupancy is None else round(occupancy.pressure, 3),
                    evictions=None if occupancy is None else occupancy.evictions,
                    ceiling=self.admission.ceiling,  # set: the latency cap trimmed
                )
            if self.admission.limit != before:
                self.tracer.counter("admission_limit", self.admission.limit, time.time_ns())
            if self.admission.ceiling != ceiling:
                ceiling = self.admission.ceiling
                self.tracer.counter("admission_ceiling", ceiling or 0, time.time_ns())

    def _count_active(self, delta: int) -> None:
        now = time.monotonic()
        self.active_s += self.active * (now - self._active_since)
        self._active_since = now
        self.active += delta

    def _episode_done(self, ep: asyncio.Task[None]) -> None:
        self._episodes.discard(ep)
        if not ep.cancelled() and ep.exception() is not None and self._failure is None:
            self._failure = ep.exception()

    async def _episode(self, d: Delivery[Task], member: int, state: EpisodeState | None) -> None:
        def make() -> tuple[Agent, Environment]:
            return self.episodes.make(d.msg, member)

        try:
            on_turn = self._save_state if self._resuming else None
            traj = await self.runner.run(d.msg, member, make, resume=state, on_turn=on_turn)
        except Exception as err:
            # Set here, before the slot's release wakes the starter: nothing starts after it.
            if self._failure is None:
                self._failure = err
            raise
        finally:
            self._count_active(-1)
            self.follower.lock.leave()
            async with self._changed:
                self._changed.notify_all()
        running = self._tasks[d.entry_id]
        running.unfinished -= 1
        # The cursor lets a grouper rebuild the task to re-run a member lost to a timeout.
        traj = msgspec.structs.replace(traj, cursor=d.msg.cursor)
        self._states.pop(traj.traj_id, None)  # its commit replaces the state
        self._outbox.append((d, traj, running.unfinished == 0))
        self._outbox_ready.set()

    def _save_state(self, state: EpisodeState) -> None:
        """An episode's turn boundary: its state goes into the next commit."""
        self._states[state.traj_id] = encode_state(state)
        self._outbox_ready.set()

    # -- output ------------------------------------------------------------------------------

    async def _committer(self) -> None:
        """Commit the trajectories that ended since the last commit, in one transaction
        with the acknowledgement of each task whose last member is among them."""
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            await self._commit_outbox()
            if self._closing and not self._outbox:
                return

    async def _commit_outbox(self) -> None:
        batch, self._outbox = self._outbox, []
        states, self._states = self._states, {}
        bare, self._bare_acks = self._bare_acks, []
        if not (batch or states or bare):
            return
        stats = self.keys.stats
        acked = [*(d for d, _, last in batch if last), *bare]  # tasks this commit acknowledges
        acks = [d.entry_id for d in acked]
        resumed = [t for _, t, _ in batch if "resumed_turn" in t.timings]
        # Episodes by status, a mixture's trajectories by task, and tasks done: the
        # feeder's own, and re-runs of a timed-out group's missing members.
        fields = Counter(counters.episodes(t.status) for _, t, _ in batch)
        if self.cfg.tasks:
            fields.update(counters.per_task(t.task, counters.TRAJECTORIES) for _, t, _ in batch)
        fields.update(
            counters.TASKS_DONE if d.msg.members is None else counters.RERUN_TASKS_DONE
            for d in acked
        )

        def count(p: Pipeline) -> None:
            if batch:
                p.hincrby(stats, counters.TRAJECTORIES, len(batch))
            for field, k in fields.items():
                p.hincrby(stats, field, k)
            if resumed:
                p.hincrby(stats, counters.EPISODES_RESUMED, len(resumed))
                saved_s = sum(t.timings["saved_s"] for t in resumed)
                p.hincrbyfloat(stats, counters.EPISODES_RESUMED_SAVED_S, round(saved_s, 6))
            if self._resuming:
                self._stage_episode_states(p, states, batch, acked)

        outputs = [(self.keys.trajectories, t) for _, t, _ in batch]
        if self._on_cluster:
            await self.threads.redis_call(self.input.commit, acks, outputs, count)
        else:
            await self.input.acommit(self.aclient, acks, outputs, count)
        for entry_id in acks:
            self._tasks.pop(entry_id, None)  # a bare ack's task was never running
        if states:
            await afailpoint(EPISODE_SAVED, self.log)
        if not batch:
            return
        self._count_committed([t for _, t, _ in batch])
        self._log_committed(batch)

    def _count_committed(self, trajectories: list[Trajectory]) -> None:
        """Committed trajectories as counters: how many, their rewards, whether each solved
        its task, and their policy age (versions between the oldest turn's policy and the
        newest version this worker has seen published)."""
        if self.metrics is None:
            return
        m = self.metrics
        m.count(TRAJECTORIES, len(trajectories))
        newest = max(self.follower.newest_version, self.follower.loaded_version)
        for t in trajectories:
            m.observe(REWARD, t.reward)
            m.observe(SOLVED, float(t.reward >= SOLVED_REWARD))
            if t.versions:
                m.observe(POLICY_AGE, max(0, newest - min(t.versions)))

    def probe(self) -> dict[str, float]:
        """Levels for `streamrl.obs.metrics` (read on its thread): episodes running, the
        version served."""
        out: dict[str, float] = {ACTIVE_EPISODES: self.active}
        if self.follower.loaded_version >= 0:  # none loaded yet: no version to show
            out[POLICY_VERSION] = self.follower.loaded_version
        return out

    def _log_committed(self, batch: list[tuple[Delivery[Task], Trajectory, bool]]) -> None:
        """Log the trajectories of a commit."""
        rows = [
            {
                "traj_id": t.traj_id,
                "task": t.task,
                "entry_id": d.entry_id,
                "status": t.status,
                "reward": t.reward,
                "versions": t.versions,
                "tokens": len(t.token_array()),
                "tool_calls": t.num_tool_calls,
                "error": t.error or None,
                "episode_s": round(t.timings.get("episode_s", 0.0), 4),
                **(
                    {"resumed_turn": int(t.timings["resumed_turn"])}
                    if "resumed_turn" in t.timings
                    else {}
                ),
            }
            for d, t, _ in batch
        ]
        # A line per LOG_ROWS of them: one line of a big batch (112 trajectories, 22 KB)
        # outgrew a log file's run.log_max_mb and could not roll over.
        for i in range(0, len(rows), LOG_ROWS):
            self.log.info(
                "trajectories_committed",
                trajectories=rows[i : i + LOG_ROWS],
                part=i // LOG_ROWS,
                parts=-(-len(rows) // LOG_ROWS),
            )

    def _stage_episode_states(
        self,
        p: Pipeline,
        states: dict[str, bytes],
        batch: list[tuple[Delivery[Task], Trajectory, bool]],
        acked: list[Delivery[Task]],
    ) -> None:
        """Queue the episode-state writes of a commit: the turn boundaries' states; for a
        committed trajectory, the marker that keeps its member from running again while its
        task is not acknowledged; for an acknowledged task, no entry of any member."""
        key = self.keys.episodes
        done = {d.entry_id for d in acked}
        marks = {
            t.traj_id: encode_state(EpisodeState(traj_id=t.traj_id, committed=True))
            for d, t, _ in batch
            if d.entry_id not in done
        }
        if states or marks:
            mapping: dict[FieldT, EncodableT] = {k: v for k, v in (states | marks).items()}
            p.hset(key, mapping=mapping)
        for d in acked:
            p.hdel(key, *(traj_id(d.msg, m) for m in d.msg.member_indices()))

    # -- liveness ----------------------------------------------------------------------------

    def _tick(self) -> None:
        """The liveness tick of a turn of the event loop (a blocking call would hold it),
        unless the engine has had work and finished no step for run.liveness_timeout_s
        (review N9: a thread wedged in a step made every episode time out while the worker
        looked live); then the beat stops and `streamrl up` restarts the worker."""
        stalled = self.server.stalled_s()
        limit = self.cfg.run.liveness_timeout_s
        if stalled < limit:
            self._stall_logged = False
            self.liveness.tick()
        elif not self._stall_logged:
            self._stall_logged = True
            self.log.error("engine_stalled", stalled_s=round(stalled, 1), limit_s=limit)

    async def _heartbeat(self) -> None:
        """Touch the tasks this worker still owns, on the async client (no thread pool that
        blocking work could fill may delay it past `claim_idle_ms`), and advertise its
        episode slots to the feeder (`streamrl.capacity`: task.max_backlog = "auto")."""
        every = self.cfg.transport.claim_idle_ms / 3000
        while not self._stopping:  # as well as cancelled: a cancel can be lost (run/tasks.py)
            await self._advertise(
                keys=[self.keys.rollout_capacity],
                args=[self.input.name, self.admission.limit],  # the feeder's backlog
            )
            await asyncio.sleep(every)
            ids = [e for e, r in self._tasks.items() if r.owned]
            if not ids:
                continue
            lost = await self._touch(
                keys=[self.keys.tasks], args=[self.keys.CG_ROLLOUT, self.input.name, *ids]
            )
            for raw in lost:
                entry_id = raw.decode() if isinstance(raw, bytes) else str(raw)
                running = self._tasks.get(entry_id)
                if running is not None:  # else acknowledged since: not lost
                    running.owned = False
                    self.log.warning("task_claimed_by_another_worker", entry_id=entry_id)
