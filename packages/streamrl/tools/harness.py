"""The hidden-test harness of the code task, run by the `run_tests` tool in the sandbox.

It reads {code, entry, inputs, marker} as JSON on stdin, runs the candidate code, calls
`entry(*args)` for each input and prints one line: the marker followed by a JSON list of
{"ok": true, "value": ...} or {"ok": false, "error": ...}. Values that JSON cannot carry
become their repr (and so never equal an expected value). Expected values are not here:
the trusted side compares.
"""

SOURCE = r"""
import json, sys
spec = json.loads(sys.stdin.read())
marker = spec["marker"]
out = sys.stdout
ns = {"__name__": "candidate"}
try:
    exec(compile(spec["code"], "<candidate>", "exec"), ns)
    fn = ns[spec["entry"]]
except BaseException as err:
    failed = {"ok": False, "error": "load: " + type(err).__name__}
    out.write("\n" + marker + json.dumps([failed] * len(spec["inputs"])) + "\n")
    out.flush()
    raise SystemExit(0)
results = []
for args in spec["inputs"]:
    try:
        value = fn(*args)
        json.dumps(value)
        results.append({"ok": True, "value": value})
    except BaseException as err:
        results.append({"ok": False, "error": type(err).__name__})
out.write("\n" + marker + json.dumps(results, default=repr) + "\n")
out.flush()
"""
