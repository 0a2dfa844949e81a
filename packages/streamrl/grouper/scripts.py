"""The grouper's Lua scripts (`lua/*.lua`, shipped as package data), each with the stats
fields it counts (`streamrl.counters`, as `C.NAME`) and its KEYS and ARGV documented in it."""

from __future__ import annotations

from importlib import resources

from streamrl.counters import lua_prelude

ADD_MEMBER = "add_member"
EMIT = "emit"
DROP = "drop"
TIMEOUT = "timeout"
COUNT_AFTER = "count_after"
SCRIPTS = (ADD_MEMBER, EMIT, DROP, TIMEOUT, COUNT_AFTER)


def source(name: str) -> str:
    """The script `name` as Redis runs it: its file, after the line defining `C`."""
    text = resources.files("streamrl.grouper").joinpath("lua", f"{name}.lua").read_text()
    return lua_prelude(text) + text
