"""Every name `Keys` builds is a key of the run's one hash slot (Redis Cluster)."""

from __future__ import annotations

import inspect

import pytest

from streamrl.names import Keys


def every_name(keys: Keys) -> dict[str, str]:
    """Each public property and method of `keys`, called with placeholder arguments."""
    out: dict[str, str] = {}
    for attr, member in inspect.getmembers(Keys):
        if attr.startswith("_") or attr == "ns" or isinstance(member, str):
            continue  # the namespace itself, consumer-group names (not keys)
        value = getattr(keys, attr)
        if callable(value):
            params = inspect.signature(value).parameters.values()
            args = [7 if p.annotation in (int, "int") else "x" for p in params]
            value = value(*args)
        for i, name in enumerate(value if isinstance(value, tuple) else (value,)):
            out[f"{attr}[{i}]"] = name
    return out


def test_every_key_carries_the_run_tag() -> None:
    names = every_name(Keys("run-1"))
    assert len(names) > 25  # every property and method was reached
    untagged = {attr: n for attr, n in names.items() if not n.startswith("{run-1}:")}
    assert untagged == {}
    assert Keys("run-1").prefix == "{run-1}:"


@pytest.mark.parametrize("ns", ["a{b}", "a}b", "a[b]", "a*", "", "x" * 65])
def test_namespace_holds_no_brace_or_glob(ns: str) -> None:
    with pytest.raises(ValueError, match="invalid run namespace"):
        Keys(ns)


def test_run_directory_paths_are_named_once() -> None:
    """RunPaths names the run directory's parts; no module joins their names again
    (`"checkpoints"` was typed in four places)."""
    import re
    from pathlib import Path

    from streamrl.names import RunPaths
    from streamrl.obs.tracing import TRACES_DIR
    from streamrl.weightsync import WEIGHTS_DIR

    paths = RunPaths(Path("/r"))
    assert (paths.checkpoints, paths.summary) == (Path("/r/checkpoints"), Path("/r/summary.json"))
    assert paths.stderr("tools-0") == Path("/r/logs/tools-0.stderr")
    assert (TRACES_DIR, WEIGHTS_DIR) == (RunPaths.TRACES, RunPaths.WEIGHTS)
    names = "|".join(
        re.escape(n)
        for n in ("checkpoints", "logs", "export", "eval", "traces", "weights", "summary.json")
    )
    joined = re.compile(rf'/ "({names})"')
    repo = Path(__file__).resolve().parents[2]
    found = [
        f"{p.relative_to(repo)}: {m.group(0)}"
        for p in [*(repo / "packages").rglob("*.py"), *(repo / "workers").rglob("*.py")]
        for m in joined.finditer(p.read_text())
    ]
    assert not found, found
