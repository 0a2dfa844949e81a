"""compose/compose.yaml: local images, the real `streamrl worker` commands with scalable
identities, one Redis user and secret per role, health checks the real CLI parses, volumes
only where needed, and no engine socket in the tools service (tests/compose/ brings the
stack up for real)."""

from pathlib import Path
from typing import Any

import yaml

from streamrl.config import load_config
from streamrl.run.runtime import WORKER_NAMES
from streamrl_workers.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((REPO / "compose" / "compose.yaml").read_text())
    return data


def _expand(arg: str) -> str:
    """A `${VAR:-default}` argument as compose expands it with VAR unset."""
    if arg.startswith("${") and ":-" in arg:
        return arg[arg.index(":-") + 2 : -1]
    return arg


def test_every_worker_has_a_service() -> None:
    services = _compose()["services"]
    assert {"redis", "sandbox-proxy"} <= set(services)
    assert set(WORKER_NAMES) <= set(services)


def test_worker_commands_parse_with_the_real_cli() -> None:
    services = _compose()["services"]
    parser = build_parser()
    for name in WORKER_NAMES:
        svc = services[name]
        args = parser.parse_args([_expand(a) for a in svc["command"]])
        assert args.command == "worker" and args.name == name
        assert args.index == "auto"  # every replica claims an identity of its own
        # its counters on a port of its own container (streamrl.obs.metrics)
        metrics = load_config(REPO / args.config, args.set).metrics
        assert (metrics.prometheus_port, metrics.prometheus_host) == (9100, "0.0.0.0")
        load_config(REPO / args.config)  # a real, valid file of this repo
        test = svc["healthcheck"]["test"]
        assert test[:2] == ["CMD", "streamrl"]
        health = parser.parse_args([_expand(a) for a in test[2:]])
        assert health.command == "health" and health.worker == name


def test_images_are_local_and_never_pulled() -> None:
    for name, svc in _compose()["services"].items():
        assert svc["image"].startswith("localhost/streamrl-"), name
        assert svc.get("pull_policy") == "never", name
        assert "build" not in svc, name  # `make images` builds them, offline


def test_each_worker_connects_as_its_own_user_with_its_own_secret() -> None:
    compose = _compose()
    services = compose["services"]
    for name in WORKER_NAMES:
        env = services[name]["environment"]
        assert env["REDIS_URL"] == f"redis://{name}@redis:6379/0"
        assert env["REDIS_PASSWORD_FILE"] == f"/run/secrets/{name}.password"
        assert services[name]["secrets"] == [f"{name}.password"]
    assert set(compose["secrets"]) == {"users.acl", *(f"{n}.password" for n in WORKER_NAMES)}
    # No password anywhere in a command line or an environment (docker inspect shows both).
    text = (REPO / "compose" / "compose.yaml").read_text()
    assert "requirepass" not in text and "REDIS_PASSWORD:" not in text
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--aclfile") + 1] == "/run/secrets/users.acl"
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"


def test_only_the_proxy_holds_the_engine_socket() -> None:
    services = _compose()["services"]
    proxy = services["sandbox-proxy"]
    assert any("/run/engine.sock" in v for v in proxy["volumes"])
    assert proxy["network_mode"] == "none" and proxy["cap_drop"] == ["ALL"]
    args = build_parser().parse_args(proxy["command"])
    assert args.command == "sandbox-proxy"
    tools = services["tools"]
    assert tools["environment"]["DOCKER_HOST"] == "unix:///run/sandbox/docker.sock"
    assert tools["volumes"] == ["sandbox-socket:/run/sandbox:ro"]  # no run, cache or engine
    for name, svc in services.items():
        if name != "sandbox-proxy":
            assert not any("engine.sock" in v or ".sock:" in v for v in svc.get("volumes", []))


def test_volumes_only_where_needed_and_workers_hardened() -> None:
    services = _compose()["services"]
    for name in ("feeder", "grouper", "tools"):
        mounts = [v.split(":")[0] for v in services[name].get("volumes", [])]
        assert "run" not in mounts and "model-cache" not in mounts, name
    for name in ("rollout", "trainer", "colocated"):
        assert "run:/run/streamrl" in services[name]["volumes"], name
    for name in WORKER_NAMES:
        svc = services[name]
        assert svc["init"] is True and svc["read_only"] is True, name
        assert svc["restart"].startswith("on-failure:"), name  # a limit on restarts
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name


def test_the_proxy_caps_fit_the_tools_config_and_nothing_more() -> None:
    """Review N6: compose could not lower the proxy's per-container ceilings (16 GiB, 4096
    pids, 64 CPUs). Now its flags are the tools config's own values: what a tool worker of
    the default config asks for passes, and nothing bigger."""
    from streamrl.config import load_config

    args = build_parser().parse_args(_compose()["services"]["sandbox-proxy"]["command"])
    tools = load_config(REPO / "configs" / "tiny.toml").tools
    assert args.max_memory_mb == tools.memory_mb and args.max_pids == tools.pids_limit
    assert args.max_cpus == tools.cpus
    assert args.max_containers >= tools.num_workers * tools.max_containers
    assert args.stream_idle_s >= tools.time_limit_s + tools.result_margin_s
