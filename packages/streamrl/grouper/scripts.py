"""The grouper's Lua scripts (`lua/*.lua`, shipped as package data), each with the stats
fields it counts (`streamrl.counters`, as `C.NAME`) and its KEYS and ARGV documented in it."""

from __future__ import annotations

from importlib import resources
from typing import Any

from streamrl.config import GrouperConfig
from streamrl.counters import lua_prelude
from streamrl.names import Keys
from streamrl.wire import SCHEMA_VERSION, Group

ADD_MEMBER = "add_member"
EMIT = "emit"
DROP = "drop"
TIMEOUT = "timeout"
COUNT_AFTER = "count_after"
ORDER_FLUSH = "order_flush"
SCRIPTS = (ADD_MEMBER, EMIT, DROP, TIMEOUT, COUNT_AFTER, ORDER_FLUSH)
# Scripts that write or drop groups: they get the submission-order library (lua/order.lua).
ORDERED = (EMIT, DROP, TIMEOUT, ORDER_FLUSH)


def _file(name: str) -> str:
    return resources.files("streamrl.grouper").joinpath("lua", f"{name}.lua").read_text()


def source(name: str) -> str:
    """The script `name` as Redis runs it: the line defining `C`, the order library where
    the script writes or drops groups, then its file."""
    text = (_file("order") if name in ORDERED else "") + _file(name)
    return lua_prelude(text) + text


def order_tail(keys: Keys, gcfg: GrouperConfig, cursor: int) -> tuple[list[str], list[Any]]:
    """The KEYS and ARGV the ORDERED scripts take after their own (lua/order.lua) for a
    group of task `cursor` (-1 unknown)."""
    tail_keys = [
        keys.groups_order_next,
        keys.groups_order_held,
        keys.groups_order_held_at,
        keys.groups,
    ]
    mode = "submission" if gcfg.order == "submission" else ""
    return tail_keys, [mode, cursor, gcfg.order_window, SCHEMA_VERSION, Group.KIND]
