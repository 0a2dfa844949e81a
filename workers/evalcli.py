"""`streamrl eval`: the policy's quality on the held-out split, optionally gated.

    streamrl eval --config configs/tiny.toml --run-dir runs/tiny --n 200 --samples 4 --json
    streamrl eval --checkpoint runs/tiny/export --n 200 --gate baseline.json --tolerance 0.05
    streamrl eval --config configs/tiny.toml --watch runs/tiny --n 100   # the run's evaluator

--watch RUN_DIR is the evaluator of a run with trainer.eval_every (`streamrl up` starts it):
it evaluates the snapshots the trainer writes into RUN_DIR/eval/ until the run drains it
(`streamrl.evaluation.watch`). Logic in `streamrl.evaluation` (episodes), `streamrl.tasks.heldout`
(the split) and `streamrl.evaluation.stats` (intervals, pass@k, the gate rule).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamrl.config import Config
    from streamrl.evaluation import EvalResult
    from streamrl.evaluation.stats import GateVerdict
    from streamrl.jsontypes import JSONObject

GATE_RULE = (
    "--gate fails (exit 1) when the greedy solve rate fell by more than --tolerance below "
    "the baseline's and its 95% Wilson interval says so: the top of the interval is below "
    "baseline - tolerance (the baseline's point estimate taken as exact). Exit 0: no gate, "
    "or it passed; 2: bad arguments, config, checkpoint or baseline; 3: the tool sandbox "
    "is unavailable."
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser(
        "eval",
        help="evaluate a policy on the held-out split (solve rate, pass@k, 95%% intervals)",
        description=__doc__,
        epilog=GATE_RULE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = e.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", type=Path, help="Hugging Face checkpoint directory")
    which.add_argument(
        "--run-dir", type=Path, help="run directory: its newest complete trainer checkpoint"
    )
    which.add_argument(
        "--initial",
        action="store_true",
        help="the policy a run of --config starts from (model.checkpoint or the built-in "
        "one, warm-started when model.init = warmstart)",
    )
    which.add_argument(
        "--watch",
        type=Path,
        metavar="RUN_DIR",
        help="evaluate the run's snapshots as the trainer writes them (trainer.eval_every) "
        "into RUN_DIR/eval/step-N.json, at trainer.eval_niceness, until the run drains it",
    )
    e.add_argument(
        "--config",
        default=None,
        help="the run's TOML config (task, seed, rollout limits, tools, model); default: "
        "the built-in defaults. Use the run's own: the held-out split depends on it",
    )
    e.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config field (repeatable)",
    )
    e.add_argument("--task", default=None, help="task name (task.name) instead of the config's")
    e.add_argument("--n", type=int, default=100, help="held-out tasks to evaluate (default 100)")
    e.add_argument(
        "--samples",
        type=int,
        default=0,
        metavar="K",
        help="also K sampled episodes a task at the rollout's temperature: pass@1..K",
    )
    e.add_argument(
        "--solve-threshold",
        type=float,
        default=1.0,
        help="an episode is solved when its reward reaches this (default 1.0)",
    )
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.add_argument("--output", type=Path, default=None, help="also write the JSON result here")
    e.add_argument("--gate", type=Path, default=None, metavar="BASELINE.json",
                   help="a stored --json result to compare with (see below)")  # fmt: skip
    e.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="absolute solve-rate drop the gate allows (default 0.05)",
    )


def main(args: argparse.Namespace) -> int:
    from streamrl.config import ConfigError, load_config, parse_config
    from streamrl.evaluation.stats import EXIT_GATE_FAILED, EXIT_OK, EXIT_SANDBOX, EXIT_USAGE

    def fail(msg: str, code: int = EXIT_USAGE) -> int:
        print(f"streamrl eval: {msg}", file=sys.stderr)
        return code

    overrides = list(args.set) + ([f"task.name={args.task}"] if args.task else [])
    try:
        if args.config:
            cfg = load_config(args.config, overrides=overrides)
        else:
            cfg = parse_config({}, overrides=overrides)
    except ConfigError as err:
        return fail(str(err))
    if args.n < 1 or args.samples < 0 or not 0.0 <= args.tolerance <= 1.0:
        return fail("--n must be >= 1, --samples >= 0 and --tolerance in [0, 1]")
    if cfg.model.kind != "transformer":
        return fail("model.kind stub has no policy to evaluate")

    from streamrl import evaluation
    from streamrl.run.logs import configure_logging
    from streamrl.tools.sandbox import SandboxUnavailableError

    if args.watch:
        return watch(cfg, args.watch, args.n, args.solve_threshold)
    log = configure_logging("eval", stream=sys.stderr, run=cfg.run.name)
    bad_input: tuple[type[Exception], ...] = (ConfigError, *_policy_errors())
    try:
        baseline = evaluation.read_baseline(args.gate) if args.gate else None
        policy = evaluation.load_policy(cfg, args.checkpoint, args.run_dir)
        result = evaluation.evaluate(cfg, policy, args.n, args.samples, args.solve_threshold, log)
        verdict = evaluation.gate_result(result, baseline, args.tolerance) if baseline else None
    except SandboxUnavailableError as err:
        return fail(f"sandbox unavailable: {err}", EXIT_SANDBOX)
    except bad_input as err:
        return fail(str(err))
    if verdict is not None and baseline is not None:
        _add_gate(result, baseline, verdict, args.gate)
    text = json.dumps(result, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
    print(text if args.json else evaluation.render(result))
    if verdict is not None:
        print(f"gate {'passed' if verdict.passed else 'FAILED'}: {verdict.reason}", file=sys.stderr)
        return EXIT_OK if verdict.passed else EXIT_GATE_FAILED
    return EXIT_OK


def _policy_errors() -> tuple[type[Exception], ...]:
    """What loading and evaluating a policy raises for bad input: a message for the user,
    not a crash (imported once the config is parsed: they load the model stack)."""
    from streamrl.chat.hf import ChatError
    from streamrl.evaluation import EvalError
    from streamrl.model.checkpoint import CheckpointError
    from streamrl.model.spec import SpecError

    return (EvalError, ChatError, CheckpointError, SpecError)


def _add_gate(result: EvalResult, baseline: JSONObject, verdict: GateVerdict, path: Path) -> None:
    result["gate"] = {
        "baseline": str(path),
        "baseline_solve_rate": verdict.baseline,
        "tolerance": verdict.tolerance,
        "passed": verdict.passed,
        "reason": verdict.reason,
    }
    if baseline.get("split") != result["split"]:
        print("streamrl eval: warning: the baseline's held-out split differs "
              f"({baseline.get('split')} vs {result['split']})", file=sys.stderr)  # fmt: skip


def watch(cfg: Config, run_dir: Path, n: int, solve_threshold: float) -> int:
    """The run's evaluator (`streamrl.evaluation.watch.watch`), logging to
    RUN_DIR/logs/evaluator.log. Exits 0 once drained; SIGTERM stops it at once (what it had
    claimed is released when it starts again)."""
    import os

    from streamrl import evaluation
    from streamrl.evaluation import watch as evalrun
    from streamrl.evaluation.stats import EXIT_OK, EXIT_SANDBOX
    from streamrl.names import RunPaths
    from streamrl.run.logs import configure_logging
    from streamrl.run.runtime import run_log
    from streamrl.tools.sandbox import SandboxUnavailableError

    os.nice(cfg.trainer.eval_niceness)
    logs = RunPaths(run_dir).logs
    logs.mkdir(parents=True, exist_ok=True)
    log = configure_logging("evaluator", file=run_log(logs, "evaluator", cfg), run=cfg.run.name)

    unreadable: tuple[type[Exception], ...] = (*_policy_errors(), OSError)

    def evaluate(step: int, path: Path) -> EvalResult:
        try:
            policy = evaluation.load_policy(cfg, path, None)
        except unreadable as err:
            raise evalrun.SnapshotError(f"{path}: {err}") from None
        return evaluation.evaluate(cfg, policy, n, 0, solve_threshold, log)

    log.info("evaluator_start", run_dir=str(run_dir), tasks=n, pid=os.getpid())
    try:
        root = evalrun.eval_dir(run_dir)
        done = evalrun.watch(root, evaluate, lambda: False, log, every=cfg.trainer.eval_all)
    except SandboxUnavailableError as err:
        log.error("evaluator_sandbox_unavailable", error=str(err))
        return EXIT_SANDBOX
    log.info("evaluator_done", evaluated=done)
    return EXIT_OK
