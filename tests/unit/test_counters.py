"""The stats hash has one home: every field written in Python or Lua is a `streamrl.counters`
constant, declared there once, and nowhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from streamrl import counters
from streamrl.grouper import scripts

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(REPO / "packages").rglob("*.py"), *(REPO / "workers").rglob("*.py")])
LUA = sorted((REPO / "packages").rglob("*.lua"))
WRITES = {"hincrby", "hincrbyfloat"}  # a counter's field is their second argument
STATS_CALLS = {"hset", "hget", "hmget", "hincrby", "hincrbyfloat"}
# In Lua: the field of a HINCRBY, or of an HSET/HGET on the stats hash.
LUA_FIELD = re.compile(r"redis\.call\('(HINCRBY|HSET|HGET)', KEYS\[\d+\], ([^,)]+)")


def _stats_fields_typed_as_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of each counter write, or stats-hash call, whose field is a string
    literal or f-string instead of a `streamrl.counters` name."""
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, args = node.func.attr, node.args
        if name not in STATS_CALLS or len(args) < 2:
            continue
        on_stats = isinstance(args[0], ast.Attribute) and args[0].attr == "stats"
        if name not in WRITES and not on_stats:
            continue
        field = args[1]
        fields = field.elts if isinstance(field, ast.List | ast.Tuple) else [field]
        if any(isinstance(f, ast.Constant | ast.JoinedStr) for f in fields):
            bad.append((node.lineno, ast.unparse(node)))
    return bad


def test_every_counter_write_in_python_names_a_constant() -> None:
    bad = [
        f"{p.relative_to(REPO)}:{line}: {src}"
        for p in SOURCES
        for line, src in _stats_fields_typed_as_strings(ast.parse(p.read_text()))
    ]
    assert not bad, "stats fields typed as strings (use streamrl.counters):\n" + "\n".join(bad)


def test_the_check_finds_a_field_typed_as_a_string() -> None:
    tree = ast.parse(
        'pipe.hincrby(keys.stats, "groups", 1)\n'
        "client.hget(self.keys.stats, f'episodes_{s}')\n"
        "pipe.hincrby(keys.stats, counters.GROUPS, 1)\n"
        'pipe.hset(keys.other, "x", 1)\n'
    )
    assert [line for line, _ in _stats_fields_typed_as_strings(tree)] == [1, 2]


def _lua_sources() -> list[tuple[str, str]]:
    """(where, text) of every Lua script: the .lua files, and scripts held in Python strings."""
    out = [(str(p.relative_to(REPO)), p.read_text()) for p in LUA]
    for p in SOURCES:
        strings = (
            (node.lineno, node.value)
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        )
        out += [(f"{p.relative_to(REPO)}:{n}", t) for n, t in strings if "redis.call(" in t]
    return out


def test_every_counter_in_lua_is_a_constant_or_passed_in() -> None:
    known = counters.constants()
    seen = 0
    for where, text in _lua_sources():
        for op, raw in LUA_FIELD.findall(text):
            seen += 1
            field = raw.strip()
            if field.startswith("C."):
                assert field[2:] in known, f"{where}: {op} {field} is no counters constant"
            else:
                assert field.startswith("ARGV["), f"{where}: {op} field {field} typed in Lua"
    assert seen >= 20  # the grouper's scripts and the ledger's are all found


def test_each_grouper_script_gets_the_fields_it_names() -> None:
    for name in scripts.SCRIPTS:
        text = scripts.source(name)
        for const in set(re.findall(r"\bC\.([A-Z_]+)\b", text)):
            assert f"{const} = '{getattr(counters, const)}'" in text.splitlines()[0]
    assert scripts.source(scripts.COUNT_AFTER).startswith("--")  # names none: no prelude
    with pytest.raises(KeyError, match="NO_SUCH_FIELD"):
        counters.lua_prelude("redis.call('HINCRBY', KEYS[1], C.NO_SUCH_FIELD, 1)")


def test_no_module_declares_a_field_again() -> None:
    """A module-level constant whose value is a stats field, outside counters.py, is a
    second declaration (GROUPS_STALE was declared in the trainer and again in rollout).
    metrics.py is the other channel (each worker's own counters), whose names may match."""
    fields = set(counters.FIELDS)
    again = []
    for p in SOURCES:
        if p.name in ("counters.py", "metrics.py"):
            continue
        for node in ast.parse(p.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and node.value.value in fields
            ):
                again.append(f"{p.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not again, "\n".join(again)


def test_every_field_is_documented_once() -> None:
    consts = counters.constants()
    assert sorted(consts.values()) == sorted(counters.FIELDS)  # one constant a field
    for f in counters.FIELDS.values():
        assert f.doc and f.writer and f.readers, f.name
    assert counters.episodes("ok") == counters.EPISODES_OK
    assert counters.FIELDS[counters.EPISODES_RESUMED_SAVED_S].kind == "sum"
    assert counters.FIELDS[counters.POLICY_VERSION].kind == "gauge"
