"""The configuration reference, docs/config.md, rendered from the schema
(`streamrl.config.Config`): for every section and field its name, type, default, bounds
and description, in the schema's order.

    .venv/bin/python -m ops.docs.config_reference           # writes docs/config.md
    .venv/bin/python -m ops.docs.config_reference --check   # exit 1 when it is not current

The page is never edited by hand: a field added, removed or changed in
packages/streamrl/config.py changes it, and tests/unit/test_docs.py fails until it is
written again. Everything here reads the schema; nothing about a field is restated.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from streamrl.config import Config

REPO = Path(__file__).resolve().parents[2]
OUTPUT = REPO / "docs" / "config.md"
COMMAND = "python -m ops.docs.config_reference"

HEADER = f"""\
# Configuration reference

<!-- Generated from packages/streamrl/config.py by `{COMMAND}`. Do not edit:
     change the schema and run the command again (a test checks this page is current). -->

Every field of a run's config, section by section in the schema's order
(`packages/streamrl/config.py`). A run's TOML file sets any of them (`[rollout]`,
`temperature = 0.7`), and `streamrl up --set rollout.temperature=0.7` overrides one on the
command line; a field left out keeps its default. An unknown key, a value of the wrong
type or out of bounds is an error that names the field, and checks across fields (the
validators of the schema, and whether the settings fit each other: see
[Scale and capacity](scale.md)) name the fields they compare.

Types are written as in Python: `str` is a TOML string, `list[str]` an array of strings,
`dict[...]` a table. `"auto"` or `int` takes the string `"auto"`, a value the config derives
from the other fields (`streamrl up --explain` shows what it became), or a number. A
default of *unset* means the field is left out unless given. Each field has an anchor of
its own name: `config.md#rollout.temperature`.
"""


def _number(x: float) -> str:
    """A bound as written: 1e6 -> 1000000, 0.05 -> 0.05, 2**31 - 1 -> 2147483647."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return repr(x)


def _toml(value: Any) -> str:
    """A default as it would be written in TOML."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for the default {value!r} ({type(value).__name__})")


def _type_name(annotation: Any) -> str:
    """A readable type, as Markdown: `int`, `list[str]`, one of `"a"`, `"b"`, `"auto"` or
    `int`."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _type_name(get_args(annotation)[0])
    if origin is Literal:
        choices = ", ".join(_code(_toml(a)) for a in get_args(annotation))
        return f"one of {choices}" if len(get_args(annotation)) > 1 else choices
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        literals = [a for a in members if get_origin(a) is Literal]
        others = [a for a in members if get_origin(a) is not Literal]
        parts = [_code(_toml(v)) for lit in literals for v in get_args(lit)]
        parts += [_type_name(a) for a in others]
        return " or ".join(parts)
    args = get_args(annotation)
    if origin in (list, set, tuple) and len(args) == 1 and get_origin(args[0]) is not None:
        return f"{_code(origin.__name__)} of {_type_name(args[0])}"  # list of one of "a", "b"
    return _code(_python_type(annotation))


def _python_type(annotation: Any) -> str:
    """int, str, list[str], dict[str, Any]."""
    if annotation is Any:
        return "Any"
    if isinstance(annotation, type) and not get_args(annotation):
        return annotation.__name__
    origin = get_origin(annotation)
    if origin is Annotated:
        return _python_type(get_args(annotation)[0])
    if origin is Literal:
        return "Literal[" + ", ".join(_toml(a) for a in get_args(annotation)) + "]"
    if isinstance(origin, type) and get_args(annotation):
        args = ", ".join(_python_type(a) for a in get_args(annotation))
        return f"{origin.__name__}[{args}]"
    raise TypeError(f"no readable name for the type {annotation!r} in the config reference")


def _metadata(field: FieldInfo) -> list[Any]:
    """The constraints of a field: its own, and those of Annotated members of a union
    (`Annotated[int, Field(ge=1)] | Literal["auto"]`)."""
    found: list[Any] = []
    pending = list(field.metadata)
    for arg in get_args(field.annotation):
        if get_origin(arg) is Annotated:
            pending += list(arg.__metadata__)
    for m in pending:
        found += m.metadata if isinstance(m, FieldInfo) else [m]
    return found


# Numeric and length constraints: (slot, how its value is written).
_LIMITS: dict[type, tuple[str, str]] = {
    annotated_types.Ge: ("low", "{} ≤ "),
    annotated_types.Gt: ("low", "{} < "),
    annotated_types.Le: ("high", " ≤ {}"),
    annotated_types.Lt: ("high", " < {}"),
    annotated_types.MinLen: ("min_len", "{}"),
    annotated_types.MaxLen: ("max_len", "{}"),
}


def _bounds(field: FieldInfo) -> str:
    """The field's bounds: `0 < x ≤ 10`, `x ≥ 1`, `length ≤ 256`, `pattern ...`."""
    got: dict[str, str] = {}
    patterns = []
    for m in _metadata(field):
        if type(m) in _LIMITS:
            slot, form = _LIMITS[type(m)]
            got[slot] = form.format(_number(getattr(m, dataclasses.fields(m)[0].name)))
        elif getattr(m, "pattern", None) is not None:
            patterns.append(f"pattern {_code(m.pattern)}")
        else:
            raise TypeError(f"a constraint the config reference cannot render: {m!r}")
    parts = []
    if "min_len" in got and "max_len" in got:
        parts.append(f"length {got['min_len']} to {got['max_len']}")
    elif "min_len" in got or "max_len" in got:
        parts.append(
            f"length ≥ {got['min_len']}" if "min_len" in got else f"length ≤ {got['max_len']}"
        )
    if "low" in got or "high" in got:
        parts.append(f"{got.get('low', '')}x{got.get('high', '')}")
    return ", ".join(parts + patterns)


def _takes_auto(section: type[BaseModel], name: str, field: FieldInfo) -> tuple[bool, Any]:
    """Whether a numeric field also takes "auto" (a validator of the schema turns it into a
    value), and the value "auto" becomes in a section built alone."""
    if field.annotation not in (int, float):
        return False, None
    try:
        built = section.model_validate({name: "auto"})
    except ValidationError as e:
        # Another field's check failing means this field took the value.
        if any(err["loc"][:1] == (name,) for err in e.errors()):
            return False, None
        return True, None
    return True, getattr(built, name)


def _default(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    if field.default is PydanticUndefined:
        raise ValueError("a config field without a default cannot be left out")
    return field.default


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# Characters written as references inside a <code> element (see `_code`).
_MARKUP = set("|*_[]()<>&`\\!#")


def _code(text: str) -> str:
    """`text` as a code span in a table cell (a longer fence when it holds backticks).

    A `|` cannot be written in a code span of a cell so that both renderers read it:
    GitHub splits the cell at a bare one and Python-Markdown (mkdocs) shows the backslash of
    an escaped one. Such text becomes an HTML <code> element in which every character that
    Markdown or HTML could read is a character reference, which neither renderer splits at
    nor reads as markup."""
    if "|" in text:
        body = "".join(f"&#{ord(c)};" if c in _MARKUP else c for c in text)
        return f"<code>{body}</code>"
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _prose(text: str) -> str:
    """A description as one line of a table cell: code spans kept, and outside them the
    characters Markdown would read as HTML, emphasis, links or a cell's end escaped."""
    text = " ".join(text.split())
    out, pos = [], 0
    for m in _CODE_SPAN.finditer(text):
        out.append(_escape(text[pos : m.start()]))
        out.append(_code(m.group(2)) if "|" in m.group(0) else m.group(0))
        pos = m.end()
    out.append(_escape(text[pos:]))
    return "".join(out)


def _escape(text: str) -> str:
    # A bare & stays (Markdown escapes it); one that would start an entity does not.
    text = re.sub(r"&(?=#?\w+;)", "&amp;", text).replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\*\[\]|])", r"\\\1", text)


def _section_doc(section: type[BaseModel], field: FieldInfo) -> str:
    """The section's docstring, else its description in `Config`."""
    doc = section.__doc__
    if doc and doc is not BaseModel.__doc__:
        return " ".join(doc.split())
    return field.description or ""


def render() -> str:
    """The whole page, deterministic: the same schema gives the same bytes."""
    lines = [HEADER]
    for section_name, section_field in Config.model_fields.items():
        section = section_field.annotation
        entries = typing.get_args(section) if typing.get_origin(section) is list else ()
        if len(entries) == 1 and issubclass(entries[0], BaseModel):
            # an array of tables ([[tasks]]): each entry a section documented above
            of = next(n for n, f in Config.model_fields.items() if f.annotation is entries[0])
            lines.append(f"## [[{section_name}]]\n")
            lines.append(
                _prose(section_field.description or "")
                + f" Each entry takes the fields of `[{of}]` above, as `{section_name}[i].<field>`"
                f" ({_bounds(section_field) or 'any length'}).\n"
            )
            continue
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            raise TypeError(f"Config.{section_name} is not a section (a pydantic model)")
        lines.append(f"## [{section_name}]\n")
        lines.append(_prose(_section_doc(section, section_field)) + "\n")
        lines.append("| field | type | default | bounds | description |")
        lines.append("|---|---|---|---|---|")
        for name, field in section.model_fields.items():
            full = f"{section_name}.{name}"
            auto, auto_value = _takes_auto(section, name, field)
            type_name = _type_name(field.annotation)
            if auto:
                type_name = f'`"auto"` or {type_name}'
            default = _default(field)
            shown = '"auto"' if auto and auto_value == default else _toml(default)
            if field.description is None:
                raise ValueError(f"{full} has no description: the schema documents every field")
            cells = [
                f'<a id="{full}"></a>`{full}`',
                type_name,
                _code(shown) if default is not None else "*unset*",
                _bounds(field),
                _prose(field.description),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the page differs from the schema's"
    )
    parser.add_argument("--out", type=Path, default=OUTPUT, help="the page (docs/config.md)")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else None
        if current != text:
            what = "is missing" if current is None else "differs from the schema"
            print(
                f"{args.out} {what} (packages/streamrl/config.py changed): "
                f"run `{COMMAND}` and commit the page",
                file=sys.stderr,
            )
            return 1
        print(f"{args.out} is current")
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
