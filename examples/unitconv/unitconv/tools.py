"""The `convert` tool. The tool workers import this module (`tools.extra`); what runs with
the policy's arguments is the program `SOURCE`, in the sandbox, fed the call's arguments as
JSON on stdin. The table travels inside the program, so the sandbox image needs nothing."""

from __future__ import annotations

import json

from streamrl import api

# Units of one dimension, as multiples of its base unit (metre, gram, second).
UNITS: dict[str, float] = {
    "mm": 0.001,
    "cm": 0.01,
    "m": 1.0,
    "km": 1000.0,
    "in": 0.0254,
    "ft": 0.3048,
    "mi": 1609.344,
}


def convert(value: float, src: str, dst: str) -> float:
    """`value` in `src` expressed in `dst`, rounded to 2 decimals (what the tool prints)."""
    return round(value * UNITS[src] / UNITS[dst], 2)


SOURCE = f"""
import json, sys
UNITS = {json.dumps(UNITS)}
args = json.load(sys.stdin)
src, dst = args["from_unit"], args["to_unit"]
for unit in (src, dst):
    if unit not in UNITS:
        sys.exit("unknown unit " + repr(unit) + "; units: " + ", ".join(UNITS))
print(round(args["value"] * UNITS[src] / UNITS[dst], 2))
"""

CONVERT = api.python_tool(
    name="convert",
    description="Convert a length between units.",
    parameters={
        "type": "object",
        "properties": {
            "value": {"type": "number"},
            "from_unit": {"type": "string"},
            "to_unit": {"type": "string"},
        },
        "required": ["value", "from_unit", "to_unit"],
    },
    source=SOURCE,
    # The program is this package's own; the policy only fills in JSON arguments, which it
    # parses and looks up in a table: no code of the policy's runs, so like the calculator
    # it may run as a limited plain process where no isolating sandbox exists.
    needs_isolation=False,
)
