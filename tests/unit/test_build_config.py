"""The build config ships every subpackage and its data: a package missing from
pyproject.toml's list would import from a checkout and fail from a wheel (the compose
images install one)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_subpackage_is_in_the_build_config() -> None:
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    root = REPO / "packages" / "streamrl"
    found = {
        ".".join(("streamrl", *p.parent.relative_to(root).parts)) for p in root.rglob("__init__.py")
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == {"streamrl_workers"}
    # every Lua script ships as package data of its package
    for lua in root.rglob("*.lua"):
        pkg = ".".join(("streamrl", *lua.parent.parent.relative_to(root).parts))
        patterns = tool["package-data"].get(pkg, [])
        assert any(lua.match(f"*/{pat}") for pat in patterns), lua
