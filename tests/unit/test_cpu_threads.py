"""STREAMRL_XLA_CPU_THREADS (streamrl.model.cpu): XLA:CPU's intra-op pool narrowed at the
backend's start, every thread of the process free to run on all its CPUs afterwards."""

import json
import os
import subprocess
import sys

import pytest

from streamrl.model.cpu import ENV, threads_from_env

PROBE = """
import collections, json, os, sys
if sys.argv[1] == "jax first":
    import jax
from streamrl.model.cpu import narrow_from_env
narrowed = narrow_from_env()
loaded = "jax" in sys.modules
import jax.numpy as jnp
(jnp.ones((256, 256)) @ jnp.ones((256, 256))).block_until_ready()
tasks = os.listdir("/proc/self/task")
names = collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks)
print(json.dumps({
    "narrowed": narrowed,
    "jax_loaded": loaded,
    "pool": names["tf_XLAEigen"],
    "cpus": sorted(os.sched_getaffinity(0)),
    "threads_cpus": sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in tasks}),
}))
"""


def _probe(threads: str | None, order: str = "narrow first") -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if threads is not None:
        env[ENV] = threads
    out = subprocess.run(
        [sys.executable, "-c", PROBE, order], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_the_pool_is_narrowed_and_every_thread_keeps_all_cpus() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    default, narrowed = _probe(None), _probe("1")
    assert default["narrowed"] is False and default["pool"] == len(cpus)
    assert narrowed["narrowed"] is True and narrowed["pool"] == 1
    # the confinement lasted only while the backend started: no thread stays on one CPU
    assert narrowed["cpus"] == cpus and narrowed["threads_cpus"] == [cpus]
    # it loads no JAX itself (a worker's start is not made longer: the launcher takes a
    # worker silent past run.liveness_timeout_s for hung); it waits for JAX's own import
    assert narrowed["jax_loaded"] is False
    # JAX loaded already, its backend not started: the same
    late = _probe("1", "jax first")
    assert late["narrowed"] is True and late["jax_loaded"] is True and late["pool"] == 1
    assert late["threads_cpus"] == [cpus]


def test_the_variable_is_a_positive_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert threads_from_env() is None
    monkeypatch.setenv(ENV, " 2 ")
    assert threads_from_env() == 2
    for bad in ("0", "-1", "two", "1.5"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            threads_from_env()
