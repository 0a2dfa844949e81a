"""SIGKILL a grouper process mid-run: its replacement claims the pending entries and every
group is still emitted exactly once."""

import signal
import time
from pathlib import Path

import redis

from streamrl.names import Keys
from streamrl.transport import publish
from streamrl.wire import Group, decode
from tests.conftest import entries
from tests.helpers import spawn_worker, stop
from tests.integration.test_grouper import traj

N_GROUPS = 300
FAST_CLAIM = ("transport.claim_idle_ms=500", "transport.claim_every_ms=100")


def test_grouper_sigkill_mid_run(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    pipe = rclient.pipeline(transaction=False)
    for m in range(4):
        for g in range(N_GROUPS):
            publish(pipe, keys.trajectories, traj(g, m, float((g * m) % 3)))
    pipe.execute()
    first = spawn_worker("grouper", redis_url, keys.ns, tmp_path, *FAST_CLAIM)
    deadline = time.monotonic() + 60
    while rclient.xlen(keys.groups) < N_GROUPS // 4:  # well into the last members
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait()
    emitted_at_kill = rclient.xlen(keys.groups)
    assert emitted_at_kill < N_GROUPS  # it really died mid-run
    pending_at_kill = rclient.xpending(keys.trajectories, keys.CG_GROUPER)["pending"]
    second = spawn_worker("grouper", redis_url, keys.ns, tmp_path, *FAST_CLAIM, burst=True, index=1)
    assert second.wait(timeout=120) == 0
    out = [decode(f, Group) for _, f in entries(rclient, keys.groups)]
    ids = [g.group_id for g in out]
    assert len(ids) == len(set(ids)) == N_GROUPS
    assert rclient.xpending(keys.trajectories, keys.CG_GROUPER)["pending"] == 0
    log = (tmp_path / "grouper-1.log").read_text()
    # Entries the killed grouper had read but not finished (almost always some) were claimed.
    assert pending_at_kill == 0 or "claimed_idle_entry" in log
    stop(first)
