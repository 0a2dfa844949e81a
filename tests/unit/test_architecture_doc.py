"""docs/ARCHITECTURE.md documents every name `streamrl.names` builds.

A new `Keys` property or method, stream, consumer group or run-directory part that the
architecture contract does not mention fails here, naming what is missing.
"""

from __future__ import annotations

import re
from pathlib import Path

from streamrl.names import Keys, RunPaths

DOC = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"

# Public members of `Keys` that name no key, pattern or helper of the run. Everything else
# is documented, helpers included: `prefix`, `scratch` (keys of the run's slot that no worker
# uses), `streams` (the stream list) and the ACL glob patterns are names other code builds on.
SKIPPED = {
    "ns": "the run namespace itself (a dataclass field), not a name built from it",
}


def key_names() -> list[str]:
    """Every public property and method of `Keys` (consumer groups are class constants,
    checked apart), less `SKIPPED`."""
    return sorted(
        name
        for name, member in vars(Keys).items()
        if not name.startswith("_")
        and name not in SKIPPED
        and (isinstance(member, property) or callable(member))
    )


def documented(text: str, name: str) -> bool:
    """`name` appears in backticks, alone (`tasks`) or called (`worker_beat(worker, i)`)."""
    return re.search(rf"`{re.escape(name)}(`|\()", text) is not None


def missing_names(text: str, names: list[str]) -> list[str]:
    return [n for n in names if not documented(text, n)]


def test_every_keys_name_is_documented() -> None:
    names = key_names()
    assert len(names) > 30  # every property and method was reached
    assert missing_names(DOC.read_text(encoding="utf-8"), names) == []


def test_an_undocumented_name_is_reported() -> None:
    """The check fails for a name the document lacks (a name added to `Keys` tomorrow)."""
    text = DOC.read_text(encoding="utf-8")
    assert missing_names(text, ["tasks", "no_such_key_name"]) == ["no_such_key_name"]
    assert not documented("`tasks_done`", "tasks")  # a longer name does not count


def test_every_stream_is_documented_with_its_key() -> None:
    text = DOC.read_text(encoding="utf-8")
    keys = Keys("x")
    assert all(s.startswith(keys.prefix) for s in keys.streams())
    streams = [s.removeprefix(keys.prefix) for s in keys.streams()]
    missing = [s for s in streams if f"`{{<ns>}}:{s}`" not in text]
    assert missing == []


def test_every_consumer_group_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    groups = {n: v for n, v in vars(Keys).items() if n.startswith("CG_") and isinstance(v, str)}
    assert set(groups) >= {"CG_ROLLOUT", "CG_GROUPER", "CG_TRAINER"}
    missing = [n for n, v in groups.items() if f"`{n}`" not in text or f'`"{v}"`' not in text]
    assert missing == []


def test_every_run_directory_part_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    parts = {n: v for n, v in vars(RunPaths).items() if n.isupper() and isinstance(v, str)}
    assert "CHECKPOINTS" in parts
    missing = [n for n, v in parts.items() if f"`{n}`" not in text or f"`{v}" not in text]
    assert missing == []
