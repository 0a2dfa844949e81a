"""`streamrl` command line: `up` runs a whole pipeline, `worker NAME` runs one worker,
`status` shows a running one, `trace RUN_DIR` merges its Perfetto traces, `report RUN_DIR`
plots it from its files, `generate` samples once from a checkpoint, `eval` measures a policy
on the held-out split, `tools exec` runs one tool call in the sandbox.

Config is parsed before any heavy import, so a bad flag or key fails in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from streamrl.config import Config, ConfigError, load_config
from streamrl.run.runtime import NoRedisError
from streamrl_workers import (
    aclcli,
    evalcli,
    generate,
    health,
    queuescli,
    reportcli,
    sandboxproxy,
    statuscli,
    toolexec,
    tracecli,
    workerproc,
)
from streamrl_workers.args import config_arguments


def _common(p: argparse.ArgumentParser) -> None:
    config_arguments(p)
    p.add_argument("--steps", type=int, default=0, help="stop after N trainer steps")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start Redis and every worker; stop after --steps")
    _common(up)
    up.add_argument(
        "--explain",
        action="store_true",
        help="print the values the config implies (episodes and groups in flight, backlog, "
        "policy lag against grouper.off_policy_steps) and whether it fits; start nothing",
    )
    up.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest complete checkpoint",
    )
    workerproc.add_parser(sub)
    health.add_parser(sub)
    generate.add_parser(sub)
    evalcli.add_parser(sub)
    toolexec.add_parser(sub)
    queuescli.add_parser(sub)
    aclcli.add_parser(sub)
    sandboxproxy.add_parser(sub)
    plugins = sub.add_parser(
        "check-plugins",
        help="load every plug-in the config names (task, data, environment, agent, reward, "
        "tools) and exit 2 naming the first that fails; `up` runs it in a process of its own",
    )
    config_arguments(plugins, run_dir=False)
    reportcli.add_parser(sub)
    statuscli.add_parser(sub)
    tracecli.add_parser(sub)
    return parser


# The commands that need no run config (a checkpoint, the sandbox proxy's own flags, a run's
# files; status: a run directory can name the run) or load their own (eval's is optional).
NO_CONFIG: dict[str, Callable[[argparse.Namespace], int]] = {
    "generate": generate.main,
    "eval": evalcli.main,
    "sandbox-proxy": sandboxproxy.main,
    "report": reportcli.main,
    "status": statuscli.main,
    "trace": tracecli.main,
}


def _check_plugins(_args: argparse.Namespace, cfg: Config) -> int:
    """`streamrl check-plugins`: 0 when every plug-in the config names loads, else 2."""
    from streamrl.tasks.registry import check_plugins

    try:
        check_plugins(cfg)
    except ConfigError as err:
        print(f"streamrl: {err}", file=sys.stderr)
        return 2
    return 0


# The commands that need the config and no run directory.
CONFIG_ONLY: dict[str, Callable[[argparse.Namespace, Config], int]] = {
    "tools": toolexec.main,
    "acl": aclcli.main,
    "health": health.main,
    "check-plugins": _check_plugins,
}


def _fit_gate(args: argparse.Namespace, cfg: Config) -> int | None:
    """`up --explain`: the values the config implies, and exit (2 when it is refused).
    Otherwise an exit code when the config would drop most of its own work as stale (it
    starts nothing), else None."""
    from streamrl.fit import check_fit, fit

    if getattr(args, "explain", False):
        explained = fit(cfg)
        print(explained.explain())
        return 2 if explained.problems() else 0
    try:
        check_fit(cfg)
    except ConfigError as err:
        print(f"streamrl: {err} (streamrl up --explain shows the arithmetic)", file=sys.stderr)
        return 2
    return None


def keep_torch_out() -> None:
    """Hide torch from this process: streamrl never runs it (JAX does the math; transformers
    only tokenizes and reads checkpoint formats), but transformers 5 imports torch whenever it
    is installed (`AutoTokenizer` -> `configuration_utils` -> `modeling_rope_utils`), about a
    second of start-up in every rollout, trainer and evaluator process of an environment that
    has torch for other reasons (the dev extra's test references). Marked absent, it is not
    found (`importlib.util.find_spec` -> None) and transformers runs without it, as it does
    in a runtime install. Nothing is hidden from a process that already imported torch."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]
    # ... and then it would print "PyTorch was not found. Models won't be available" to
    # every worker's stderr (as it does in a runtime install): an advice for model users.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in NO_CONFIG:
        return NO_CONFIG[args.command](args)
    try:
        cfg = load_config(args.config, overrides=args.set)
    except ConfigError as err:
        print(f"streamrl: {err}", file=sys.stderr)
        return 2
    if args.command in CONFIG_ONLY:
        return int(CONFIG_ONLY[args.command](args, cfg))
    resume = getattr(args, "resume", None)
    if resume and args.run_dir and Path(args.run_dir).resolve() != Path(resume).resolve():
        print("streamrl: --resume names the run directory; drop --run-dir", file=sys.stderr)
        return 2
    run_dir = Path(resume or args.run_dir or Path("runs") / cfg.run.name)
    if args.command == "queues":
        return int(queuescli.main(args, cfg, run_dir))
    if args.command in ("up", "worker") and (code := _fit_gate(args, cfg)) is not None:
        return code
    if args.command == "up":
        from streamrl.run.launcher import Launcher, check_plugins_apart

        # the user's task, options, data and tools, before any worker starts
        if (code := check_plugins_apart(args.config, args.set)) != 0:
            return code
        return Launcher(cfg, args.config, args.set, run_dir, args.steps, resume=bool(resume)).run()
    try:
        return int(workerproc.main(args, cfg, run_dir))
    except NoRedisError as err:
        print(f"streamrl: {err}", file=sys.stderr)
        return 2


def entry() -> int:
    """The `streamrl` command and `python -m streamrl_workers.cli` (every worker process the
    launcher starts): `main` in a process of its own, torch kept out (`keep_torch_out`).
    Tests call `main` in their own process, where torch stays importable."""
    keep_torch_out()
    return main()


if __name__ == "__main__":
    sys.exit(entry())
