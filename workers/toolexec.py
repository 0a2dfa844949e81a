"""`streamrl tools exec`: run one tool call through the configured sandbox, print JSON.

    streamrl tools exec --config configs/tiny.toml --tool python --args '{"code": "print(1)"}'

prints {"ok": ..., "output": ..., "error": ..., "duration_s": ..., "sandbox": ...}. Exit
status 0 when the call ran (whatever its outcome), 2 for a bad config or an unknown tool, 3
when the sandbox itself is unavailable: the configured backend cannot start, or (under
`auto`) the tool needs isolation and neither containers nor bubblewrap work here; the
message says how to fix it. The sandbox is chosen as a tool worker chooses it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from streamrl.config import Config
from streamrl_workers.args import config_arguments


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tools = sub.add_parser("tools", help="tool sandbox utilities")
    tsub = tools.add_subparsers(dest="tools_command", required=True)
    ex = tsub.add_parser("exec", help="run one tool call in the configured sandbox")
    config_arguments(ex, run_dir=False)
    ex.add_argument("--tool", required=True, help="tool name, e.g. calculator, python, shell")
    ex.add_argument("--args", required=True, help="the call's arguments as a JSON object")


def main(args: argparse.Namespace, cfg: Config) -> int:
    """One call through the sandbox `cfg.tools` configures (cfg: loaded by `cli.main`)."""
    from streamrl.plugins import PluginError
    from streamrl.run.logs import configure_logging
    from streamrl.tools.jobs import open_sandbox
    from streamrl.tools.registry import load_tools, run_call
    from streamrl.tools.sandbox import Sandbox, SandboxUnavailableError

    try:
        tools = load_tools(cfg.tools)
    except PluginError as err:
        print(f"streamrl tools exec: {err}", file=sys.stderr)
        return 2
    if args.tool not in tools:
        print(
            f"streamrl tools exec: unknown tool {args.tool!r}; known: {sorted(tools)}",
            file=sys.stderr,
        )
        return 2
    log = configure_logging("tools-exec", stream=sys.stderr)
    tool = tools[args.tool]
    try:
        sandboxes = open_sandbox(cfg.tools, cfg.run.name, "tools-exec", log)
    except SandboxUnavailableError as err:
        print(f"streamrl tools exec: sandbox unavailable: {err}", file=sys.stderr)
        return 3
    try:
        sandbox: Sandbox = sandboxes.for_call(tool.name, tool.needs_isolation)
        start = time.monotonic()
        out = run_call(
            sandbox,
            args.tool,
            args.args,
            cfg.tools.time_limit_s,
            cfg.tools.output_cap_bytes,
            tools,
        )
        duration = time.monotonic() - start
    except SandboxUnavailableError as err:
        print(f"streamrl tools exec: sandbox unavailable: {err}", file=sys.stderr)
        return 3
    finally:
        sandboxes.close()
    report = {
        "ok": out.ok,
        "output": out.output,
        "error": out.error,
        "duration_s": round(duration, 4),
        "sandbox": type(sandbox).__name__,
    }
    print(json.dumps(report))
    return 0
