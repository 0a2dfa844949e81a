"""The compose images' recipes (compose/Dockerfile.*, compose/requirements-*.txt): built from
local files only, pinned exactly as pyproject.toml pins, and the light image light.

Building and running them is tests/compose/test_images.py (`make compose-test`)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose"
# The model stack (DESIGN.md, Layering): never in the light image; torch in neither.
HEAVY = {
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax",
    "orbax-checkpoint",
    "transformers",
    "tokenizers",
    "safetensors",
    "torch",
}
LOCAL_TAGS = {
    "localhost/streamrl-base:1",
    "localhost/streamrl-light:1",
    "localhost/streamrl-full:1",
}
DOCKERFILES = sorted(COMPOSE.glob("Dockerfile*"))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(lines: list[str]) -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!]+)", line)
        assert m, f"not an exact pin: {raw!r}"
        name = _norm(m.group(1))
        assert name not in pins, f"{name} pinned twice"
        pins[name] = m.group(2)
    return pins


def _project_pins() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return _pins(deps)


def _requirements(name: str) -> dict[str, str]:
    return _pins((COMPOSE / f"requirements-{name}.txt").read_text().splitlines())


def test_light_pins_are_pyprojects_and_none_heavy() -> None:
    light, project = _requirements("light"), _project_pins()
    assert light, "empty light requirement list"
    for name, version in light.items():
        assert name in project, f"{name} is not a dependency in pyproject.toml"
        assert version == project[name], f"{name}=={version}, pyproject pins {project[name]}"
    assert sorted(HEAVY & set(light)) == []


def test_full_pins_are_exactly_pyprojects_without_torch() -> None:
    full = _requirements("full")
    assert full == _project_pins()
    assert "torch" not in full


def test_the_full_image_sets_hugetlb_for_malloc() -> None:
    """The rollout and trainer containers start as `streamrl up`'s workers do: malloc with
    transparent huge pages (streamrl.run.malloc)."""
    from streamrl.run.malloc import HUGETLB, TUNABLES_ENV

    text = (COMPOSE / "Dockerfile.full").read_text()
    assert re.search(rf"^\s*{TUNABLES_ENV}={re.escape(HUGETLB)}=1\s*$", text, re.M), text


def test_dockerfiles_start_from_local_tags_only() -> None:
    assert {p.name for p in DOCKERFILES} >= {
        "Dockerfile.light",
        "Dockerfile.full",
        "Dockerfile.redis",
    }
    for path in DOCKERFILES:
        stages: set[str] = set()
        froms = re.findall(r"(?im)^\s*FROM\s+(\S+)(?:\s+AS\s+(\S+))?", path.read_text())
        assert froms, path
        for image, stage in froms:
            assert image in LOCAL_TAGS or image in stages, f"{path.name}: FROM {image}"
            if stage:
                stages.add(stage)


def _instructions(text: str) -> list[str]:
    """Instructions with their continuation lines joined, comments dropped."""
    out: list[str] = []
    buf = ""
    for line in text.splitlines():
        if not buf and line.lstrip().startswith("#"):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        if buf.strip():
            out.append(buf.strip())
        buf = ""
    if buf.strip():
        out.append(buf.strip())
    return out


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_no_instruction_can_reach_a_package_index(path: Path) -> None:
    for ins in _instructions(path.read_text()):
        assert not re.search(r"\b(curl|wget|apt-get|apt|pip3?\s+download)\b", ins), ins
        assert not re.match(r"(?i)ADD\s+.*https?://", ins), ins
        for cmd in re.split(r"&&|;|\|\|", ins):
            if re.search(r"\bpip\b.*\binstall\b", cmd):
                assert "--no-index" in cmd.split(), f"{path.name}: {cmd.strip()}"


def test_build_script_builds_offline() -> None:
    text = (REPO / "ops" / "images" / "build.sh").read_text()
    builds = re.findall(r"(?m)^\s*podman build\s[^\n]*", text)
    assert builds
    for line in builds:
        assert "--network=none" in line and "--pull=never" in line, line


def test_python_images_install_streamrl_without_deps_and_run_as_streamrl() -> None:
    for name in ("light", "full"):
        ins = _instructions((COMPOSE / f"Dockerfile.{name}").read_text())
        local = [i for i in ins if "/local/" in i and "install" in i]
        assert local and all("--no-deps" in i.split() for i in local), name
        assert "USER 10001:10001" in ins, name
        assert 'ENTRYPOINT ["/opt/streamrl/venv/bin/streamrl"]' in ins, name
        assert any(i.startswith("COPY configs ") for i in ins), name


def test_every_package_directory_is_in_the_wheel() -> None:
    """The images install streamrl from its wheel: a subpackage missing from pyproject's
    explicit package list works in the editable dev install and breaks every image."""
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    roots = {name: REPO / path for name, path in setup["package-dir"].items()}
    found = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found.add(".".join((name, *rel.parts)))
    assert sorted(found - listed) == []
