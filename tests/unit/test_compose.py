"""compose/compose.yaml runs Redis and every worker with the real `streamrl worker` command."""

from pathlib import Path
from typing import Any

import yaml

from streamrl.config import load_config
from streamrl.runtime import WORKER_NAMES
from streamrl_workers.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((REPO / "compose" / "compose.yaml").read_text())
    return data


def test_every_worker_has_a_service() -> None:
    services = _compose()["services"]
    assert "redis" in services
    assert set(WORKER_NAMES) <= set(services)


def test_worker_commands_parse_with_the_real_cli() -> None:
    services = _compose()["services"]
    parser = build_parser()
    for name in WORKER_NAMES:
        svc = services[name]
        args = parser.parse_args(svc["command"])
        assert args.command == "worker" and args.name == name
        # The config a container uses is a real, valid file of this repo.
        load_config(REPO / args.config)
        assert "REDIS_URL" in svc["environment"]
        assert svc["build"]["dockerfile"] == "compose/Dockerfile"


def test_redis_service_keeps_an_aof_and_a_password() -> None:
    cmd = _compose()["services"]["redis"]["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert "--requirepass" in cmd


def test_dockerfile_installs_the_cli() -> None:
    text = (REPO / "compose" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["streamrl"]' in text and "pip install" in text
