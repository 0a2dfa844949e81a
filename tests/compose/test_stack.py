"""The compose stack for real (`make compose-test`): images built offline, the stack up under
podman-compose, the tiny config trained to a few steps while tools and groupers are scaled
and killed, every group trained once, tool calls isolated, and nothing left behind.

Needs root, podman serving the Docker API (make sandbox-host), the images (make images) and
the secrets (make compose-secrets); `make compose-test` does all of it, then runs this.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamrl.config import load_config
from streamrl.model.tiny import ensure_checkpoint
from streamrl.trainer.warmstart import cache_path, warmstart_params
from tests.helpers import REPO, model_cache_dir

# slow too: left out of plain `-m "not slow"` runs; `make test` selects it (as root) with
# `-m "not slow or compose"`, last, once its images are built (tests/compose/conftest.py)
pytestmark = [pytest.mark.compose, pytest.mark.slow]

PROJECT = "streamrl-ci"
COMPOSE_FILE = REPO / "compose" / "compose.yaml"
CONFIG = "configs/tiny.toml"
# Long enough that the scaling and the kills happen while it trains: from a seeded warm start
# (seed_model_cache) training begins at once, and 10 steps took 40 s from `up`.
STEPS = 16
ENGINE = os.environ.get("STREAMRL_ENGINE_SOCKET", "/run/streamrl-podman.sock")
SECRETS = Path(os.environ.get("STREAMRL_SECRETS", REPO / "build" / "compose-secrets"))
PODMAN_COMPOSE = os.environ.get("PODMAN_COMPOSE", str(REPO / ".venv" / "bin" / "podman-compose"))


def run(*cmd: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=False, env=_env(), cwd=REPO
    )
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", "/etc/streamrl/containers.conf"),
        "STREAMRL_STEPS": str(STEPS),
        "STREAMRL_CONFIG": CONFIG,
        "STREAMRL_ENGINE_SOCKET": ENGINE,
        "STREAMRL_SECRETS": str(SECRETS),
    }


def compose(*args: str, check: bool = True, timeout: float = 600) -> str:
    cmd = [PODMAN_COMPOSE, "-p", PROJECT, "-f", str(COMPOSE_FILE), *args]
    return run(*cmd, check=check, timeout=timeout).stdout


def containers(service: str | None = None, all_: bool = True) -> list[dict[str, Any]]:
    cmd = [
        "podman",
        "ps",
        "--format",
        "json",
        "--filter",
        f"label=io.podman.compose.project={PROJECT}",
    ]
    if all_:
        cmd.append("-a")
    if service:
        cmd += ["--filter", f"label=io.podman.compose.service={service}"]
    found: list[dict[str, Any]] = json.loads(run(*cmd).stdout or "[]")
    return found


def names(service: str, running: bool = True) -> list[str]:
    out = []
    for c in containers(service):
        if not running or c.get("State") == "running":
            out.append(c["Names"][0])
    return sorted(out)


def wait_for(what: str, cond: Any, timeout_s: float, every_s: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{_logs()}")


def _logs() -> str:
    tail = []
    for c in containers():
        name = c["Names"][0]
        logs = run("podman", "logs", "--tail", "15", name, check=False)
        tail.append(
            f"--- {name} ({c.get('State')}, exit {c.get('ExitCode')})\n{logs.stdout}{logs.stderr}"
        )
    return "\n".join(tail)


def teardown() -> None:
    """Everything of the project: containers (any replica), the sandbox containers its tool
    workers started (a killed worker cannot remove its own), its volumes and network."""
    hosts = {c["Id"][:12] for c in containers()}
    compose("down", "-v", "-t", "2", check=False, timeout=300)
    ids = [c["Id"] for c in containers()]
    if ids:
        run("podman", "rm", "-f", "--depend", "-t", "0", *ids, check=False)
    sandboxes = json.loads(run("podman", "ps", "-a", "--format", "json", "--filter",
                               "label=streamrl.sandbox").stdout or "[]")  # fmt: skip
    ours = [
        c["Id"]
        for c in sandboxes
        if c.get("Labels", {}).get("streamrl.owner", "").split(":")[0] in hosts
    ]
    if ours:
        run("podman", "rm", "-f", "-t", "0", *ours, check=False)
    vols = run("podman", "volume", "ls", "--format", "{{.Name}}").stdout.split()
    left = [v for v in vols if v.startswith(f"{PROJECT}_")]
    if left:
        run("podman", "volume", "rm", "-f", *left, check=False)
    nets = run("podman", "network", "ls", "--format", "{{.Name}}").stdout.split()
    if f"{PROJECT}_default" in nets:
        run("podman", "network", "rm", "-f", f"{PROJECT}_default", check=False)


def seed_model_cache() -> bool:
    """Copy the config's built-in checkpoint and warm start from the test sessions' model
    cache (tests/helpers.py, `model_cache_dir`) into the stack's model volume, owned by the
    images' user: the stack's trainer and rollout then read the warm start that pytest
    trained instead of training it again in a container (about 100 s of these 2 cores).
    Entries are keyed by content, so they are the stack's own. False (and the stack trains
    it, as a user's first run does) when that cache is off. A warm start not in the cache
    yet is trained here first, or waited for (under its lock) while a test process or
    `make test`'s prewarm trains it: the stack tested is the same either way."""
    cache = model_cache_dir()
    if cache is None:
        return False
    cfg = load_config(REPO / CONFIG, [f'model.cache_dir="{cache}"'])
    warm = cache_path(cfg)
    if not (warm / "config.json").is_file():
        warmstart_params(cfg)
    ckpt = ensure_checkpoint(cfg)
    volume = f"{PROJECT}_model-cache"
    run("podman", "volume", "create", volume)
    copy = "cp -R /src/. /cache/ && chown -R 10001:10001 /cache && chmod 0700 /cache"
    run("podman", "run", "--rm", "--pull=never", "--network=none", "--user", "0",
        "-v", f"{volume}:/cache", "-v", f"{ckpt}:/src/{ckpt.name}:ro",
        "-v", f"{warm}:/src/{warm.name}:ro", "--entrypoint", "sh", "localhost/streamrl-light:1",
        "-c", copy)  # fmt: skip
    return True


SEEDED: list[bool] = []  # whether the stack started from the seeded warm start


@pytest.fixture(scope="module")
def stack() -> Iterator[None]:
    if os.geteuid() != 0 or shutil.which("podman") is None:
        pytest.fail("the compose test needs root and podman: run it through `make compose-test`")
    for image in ("streamrl-light:1", "streamrl-full:1", "streamrl-redis:1", "streamrl-sandbox:1"):
        if run("podman", "image", "exists", image, check=False).returncode != 0:
            pytest.fail(f"image {image} missing: run it through `make compose-test`")
    if not (SECRETS / "users.acl").is_file():
        pytest.fail(f"no secrets in {SECRETS}: run it through `make compose-test`")
    teardown()  # a previous run's leftovers
    SEEDED.append(seed_model_cache())
    print(f"compose stack: model volume seeded from the test cache: {SEEDED[-1]}")
    try:
        yield
    finally:
        print(_logs())
        teardown()


def trainer_exit() -> tuple[int] | None:
    """(exit code,) once the trainer's container has exited."""
    [trainer] = containers("trainer")
    if trainer.get("State") == "exited":
        return (int(trainer.get("ExitCode", -1)),)
    return None


def crash(name: str) -> None:
    """SIGKILL the worker process inside container `name` (its init's child), as a crash
    would: the container exits 137 on its own, so its restart policy applies (a `podman
    kill` counts as a user's stop, which restart policies leave alone)."""
    init = run("podman", "inspect", "--format", "{{.State.Pid}}", name).stdout.strip()
    [worker] = run("pgrep", "-P", init).stdout.split()
    os.kill(int(worker), 9)


def _restarts(name: str) -> int:
    out = run("podman", "inspect", "--format", "{{.RestartCount}}", name).stdout.strip()
    return int(out or 0)


def operator(*args: str) -> str:
    """`streamrl ARGS` in a throwaway container on the stack's network, as the operator."""
    net = f"{PROJECT}_default"
    cmd = ["podman", "run", "--rm", "--network", net, "--read-only", "--pull=never",
           "-v", f"{SECRETS / 'operator.password'}:/run/secrets/operator.password:ro",
           "-e", "REDIS_URL=redis://operator@redis:6379/0",
           "-e", "REDIS_PASSWORD_FILE=/run/secrets/operator.password",
           "localhost/streamrl-light:1", *args]  # fmt: skip
    return run(*cmd).stdout


@pytest.mark.timeout(1500)
def test_stack_trains_scales_and_survives(stack: None) -> None:
    start = time.monotonic()
    compose("up", "-d", timeout=600)
    services = ("redis", "feeder", "grouper", "tools", "rollout", "trainer", "sandbox-proxy")
    wait_for("every service running", lambda: all(names(s) for s in services), 180)
    # Scale out while the run goes on (one --scale per call in podman-compose; --no-recreate
    # keeps the running containers); replicas claim identities of their own.
    compose("up", "-d", "--no-recreate", "--scale", "tools=3", timeout=600)
    compose("up", "-d", "--no-recreate", "--scale", "grouper=2", timeout=600)
    wait_for(
        "3 tools and 2 groupers",
        lambda: len(names("tools")) == 3 and len(names("grouper")) == 2,
        120,
    )
    assert trainer_exit() is None, "the run ended before the stack was scaled: raise STEPS"
    scaled_s = time.monotonic() - start
    # Kill one of each: the restart policy brings it back, its identity with it.
    victims = [names("tools")[1], names("grouper")[0]]
    restarts = {v: _restarts(v) for v in victims}
    for victim in victims:
        crash(victim)
    wait_for(
        "the crashed tools and grouper containers to restart",
        lambda: all(_restarts(v) > restarts[v] and v in names(v.split("_")[1]) for v in victims),
        120,
    )
    (code,) = wait_for("the trainer to finish", trainer_exit, 900, every_s=5)
    assert code == 0, _logs()
    elapsed = time.monotonic() - start
    print(f"compose stack: {STEPS} trainer steps in {elapsed:.0f} s (scaled at {scaled_s:.0f} s)")
    # The trainer read the seeded warm start, or trained it (and the rollout waited for it).
    [trainer] = names("trainer", running=False)
    trainer_log = run("podman", "logs", trainer, check=False).stdout
    assert ('"warmstart.cache_hit"' if SEEDED[-1] else '"warmstart.trained"') in trainer_log

    # Every replica got a distinct identity (the heartbeat slots of the live ones).
    for service, n in (("tools", 3), ("grouper", 2)):
        for name in names(service):
            health = run("podman", "exec", name, "streamrl", "health", "--config", CONFIG,
                         "--worker", service, check=False)  # fmt: skip
            assert health.returncode == 0, (name, health.stdout, health.stderr)
        logs = [run("podman", "logs", c, check=False).stdout for c in names(service, running=False)]
        indices = {
            json.loads(line)["index"]
            for text in logs
            for line in text.splitlines()
            if '"worker_identity"' in line
        }
        assert len(indices) >= n, (service, indices)

    # Every group trained exactly once: the final checkpoint's lineage has no id twice.
    cfg = load_config(REPO / CONFIG)
    meta = json.loads(run(
        "podman", "run", "--rm", "--pull=never", "-v", f"{PROJECT}_run:/r:ro", "--entrypoint",
        "sh", "localhost/streamrl-light:1", "-c",
        "cat $(ls -d /r/checkpoints/step_* | sort | tail -1)/meta.json",
    ).stdout)  # fmt: skip
    trained = [gid for _step, ids in meta["lineage"] for gid in ids]
    assert len(trained) == STEPS * cfg.trainer.groups_per_step
    assert not [g for g, n in Counter(trained).items() if n > 1]
    # The operator's view (streamrl queues, in the stack, as the operator user): nothing
    # dead-lettered, and every group the trainer consumed acknowledged with its checkpoint.
    report = json.loads(operator("queues", "--config", CONFIG, "--json"))
    assert report["dead_by_source"] == {}, report
    [groups] = [st for st in report["streams"] if st["name"].endswith(":groups")]
    [trainer] = [g for g in groups["groups"] if g["name"] == "trainer"]
    assert trainer["pending"] == 0, groups
    assert int(report["stats"]["trainer_steps"]) == STEPS, report["stats"]

    # A tool call from inside the stack: no network, no other container's environment.
    probe = (
        "import os, socket, glob\n"
        "s = socket.socket(); s.settimeout(2)\n"
        "try:\n    s.connect(('redis', 6379)); print('NET reached redis')\n"
        "except OSError as e:\n    print('NET blocked', type(e).__name__)\n"
        "envs = []\n"
        "for p in glob.glob('/proc/[0-9]*/environ'):\n"
        "    try:\n        envs.append(open(p, 'rb').read())\n"
        "    except OSError:\n        pass\n"
        "print('ENV leaked' if any(b'REDIS' in e for e in envs) else 'ENV clean')\n"
    )
    tools = names("tools")[0]
    out = run("podman", "exec", tools, "streamrl", "tools", "exec", "--config", CONFIG,
              "--set", "tools.sandbox=container", "--tool", "python",
              "--args", json.dumps({"code": probe})).stdout  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"], result
    assert "NET blocked" in result["output"] and "ENV clean" in result["output"], result
    assert_nothing_left_behind()


def assert_nothing_left_behind() -> None:
    """The teardown leaves no container, volume or network of the project. The end of the
    stack test, not a test of its own: the compose tests run inside `make test`'s
    pytest-xdist session, where the other test process could run such a test beside the
    stack test and tear the stack down under it."""
    teardown()
    assert containers() == []
    vols = run("podman", "volume", "ls", "--format", "{{.Name}}").stdout.split()
    assert not [v for v in vols if v.startswith(f"{PROJECT}_")]
    nets = run("podman", "network", "ls", "--format", "{{.Name}}").stdout.split()
    assert f"{PROJECT}_default" not in nets
