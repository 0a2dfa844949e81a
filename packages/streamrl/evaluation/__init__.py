"""`streamrl eval`: the policy on the held-out split, through rollout's own episode code.

The policy comes from a Hugging Face checkpoint directory (an export, or any checkpoint the
run's model settings accept) or from a run directory's newest complete checkpoint (its
trained params, LoRA adapters merged into the base they trained on). Episodes run exactly
as a rollout worker runs them: the task's agent and environment (`load_episodes`), the
`EpisodeRunner` with the run's `[rollout]` limits (`max_concurrency` episodes at once),
the JAX engine behind an `EngineServer`;
tool calls run in this process through the tool workers' job code and sandbox choice
(`streamrl.tools.jobs`), without Redis.

Two passes over the held-out split (`streamrl.tasks.heldout`): greedy (top-k 1, one
episode a task), and with `samples` K > 0, K sampled episodes a task at the run's
`rollout.temperature`, `top_p`, `top_k`. Each reports (a 95 % interval on every figure;
`streamrl.evaluation.stats`): solve rate (episodes whose reward reaches `solve_threshold`;
greedy: pass@1), mean reward, the well-formed tool-call rate (calls that parse, name a
tool the episode offers and whose arguments fit its schema, of all calls attempted),
truncation rate (status truncated), error rate (status error or timeout), mean model
turns and mean sampled tokens per episode. The sampled pass adds pass@k for k = 1, 2,
4, ... and K (the unbiased estimator). The headline `solve_rate` is the greedy one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

import numpy as np
import structlog

from streamrl.agents.base import Action, Agent, Environment, Reset, StepResult
from streamrl.agents.tools import ToolArgumentError, parse_arguments
from streamrl.chat.transcript import ToolCall
from streamrl.config import Config
from streamrl.evaluation import stats as evalstats
from streamrl.jsontypes import JSONObject, number
from streamrl.model.spec import ModelSpec, PyTree
from streamrl.names import RunPaths
from streamrl.tasks.heldout import HELDOUT_CURSOR, mixture_heldout_tasks
from streamrl.wire import Task, ToolResult, Trajectory

if TYPE_CHECKING:
    from streamrl.chat.hf import HFChat
    from streamrl.model.llm import DType

RESULT_SCHEMA = 1
WORKER = "eval"


class EvalError(RuntimeError):
    """An evaluation that cannot run as asked (checkpoint, baseline); the message says why."""


# -- the result (`streamrl eval --json`, eval/step-N.json) ---------------------------------

Figure = dict[str, float | int]  # an estimate: value, lo, hi, n (`evalstats.Estimate.as_dict`)


class PassFigures(TypedDict):
    """The figures of one pass (`summarize`); the sampled pass adds `samples` and
    `pass_at_k` (`summarize_sampled`)."""

    episodes: int
    solve_rate: Figure
    reward_mean: Figure
    tool_call_wellformed_rate: Figure | None  # None: no tool calls
    tool_calls: int
    truncation_rate: Figure
    error_rate: Figure
    turns_mean: Figure
    tokens_mean: Figure
    transcripts_digest: str
    samples: NotRequired[int]
    pass_at_k: NotRequired[dict[str, Figure]]  # k (as text) -> pass@k


class TaskResult(TypedDict):
    """A mixture's result for one of its tasks (`by_task`)."""

    n: int
    greedy: PassFigures
    sampled: PassFigures | None
    solve_rate: float | int  # the greedy one


class Split(TypedDict):
    first_cursor: int
    digest: str  # `split_digest`


class Gate(TypedDict):
    """The gate's verdict in a result (`streamrl eval --gate`)."""

    baseline: str
    baseline_solve_rate: float
    tolerance: float
    passed: bool
    reason: str


class EvalResult(TypedDict):
    """What `evaluate` returns (the module doc); `streamrl eval --gate` adds `gate`, the
    run's evaluator `written_at` (`streamrl.evaluation.watch`)."""

    schema: int
    policy: str
    step: int | None
    task: str
    seed: int
    n: int
    samples: int
    solve_threshold: float
    split: Split
    greedy: PassFigures
    sampled: PassFigures | None
    solve_rate: float | int  # the greedy one
    tasks: NotRequired[dict[str, TaskResult]]  # a mixture's, by task label
    elapsed_s: float
    gate: NotRequired[Gate]


class _MixtureTasks(TypedDict, total=False):
    """`EvalResult.tasks` where the result has it (a mixture's), to unpack in its place."""

    tasks: dict[str, TaskResult]


# -- what one episode tells ----------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One episode's figures."""

    task: int  # index in the held-out split
    reward: float
    status: str
    turns: int
    tokens: int  # sampled by the policy
    calls: int  # tool calls attempted
    wellformed: int  # of which well formed
    transcript: str = ""  # digest of the episode's token ids


class CountingAgent(Agent):
    """Wraps an episode's agent and counts the tool calls of its actions: attempted, and
    well formed (parsed, a tool the episode offers, arguments that fit its schema)."""

    def __init__(self, inner: Agent) -> None:
        self.inner = inner
        self.schemas: dict[str, JSONObject] = {}
        self.calls = 0
        self.wellformed = 0

    def reset(self, reset: Reset) -> None:
        self.schemas = {
            t["function"]["name"]: t["function"].get("parameters", {}) for t in reset.tools
        }
        self.inner.reset(reset)

    def act(self, text: str) -> Action:
        action = self.inner.act(text)
        for c in action.calls:
            self.calls += 1
            if isinstance(c, ToolCall) and c.name in self.schemas:
                try:
                    parse_arguments(self.schemas[c.name], c.arguments)
                except ToolArgumentError:
                    continue
                self.wellformed += 1
        return action

    def observe(self, result: StepResult) -> None:
        self.inner.observe(result)

    def close(self) -> None:
        self.inner.close()


def outcome(task: int, tr: Trajectory, agent: CountingAgent | None) -> Outcome:
    return Outcome(
        task=task,
        reward=float(tr.reward),
        status=str(tr.status),
        turns=len(tr.versions),
        tokens=int(np.count_nonzero(tr.mask_array())),
        calls=agent.calls if agent is not None else 0,
        wellformed=agent.wellformed if agent is not None else 0,
        transcript=hashlib.blake2b(tr.tokens, digest_size=8).hexdigest(),
    )


# -- figures -------------------------------------------------------------------------------


def _rate(k: int, n: int) -> dict[str, float | int]:
    return evalstats.wilson(k, n).as_dict()


def summarize(outcomes: Sequence[Outcome], solve_threshold: float) -> PassFigures:
    """The figures of one pass (every episode counts once), each with its 95 % interval."""
    n = len(outcomes)
    solved = sum(o.reward >= solve_threshold for o in outcomes)
    calls = sum(o.calls for o in outcomes)
    return {
        "episodes": n,
        "solve_rate": _rate(solved, n),
        "reward_mean": evalstats.mean_interval([o.reward for o in outcomes]).as_dict(),
        "tool_call_wellformed_rate": (
            _rate(sum(o.wellformed for o in outcomes), calls) if calls else None
        ),
        "tool_calls": calls,
        "truncation_rate": _rate(sum(o.status == "truncated" for o in outcomes), n),
        "error_rate": _rate(sum(o.status in ("error", "timeout") for o in outcomes), n),
        "turns_mean": evalstats.mean_interval([float(o.turns) for o in outcomes]).as_dict(),
        "tokens_mean": evalstats.mean_interval([float(o.tokens) for o in outcomes]).as_dict(),
        # equal digests: the same token ids in every episode (the same greedy policy)
        "transcripts_digest": hashlib.sha256(
            "".join(o.transcript for o in outcomes).encode()
        ).hexdigest()[:16],
    }


def pass_ks(samples: int) -> list[int]:
    """The k of the sampled pass's pass@k: powers of two below `samples`, and `samples`."""
    ks = [1]
    while ks[-1] * 2 < samples:
        ks.append(ks[-1] * 2)
    return ks if ks[-1] == samples else [*ks, samples]


def summarize_sampled(
    outcomes: Sequence[Outcome], tasks: int, samples: int, solve_threshold: float
) -> PassFigures:
    """`summarize` plus pass@k over tasks (`samples` episodes each)."""
    correct = [0] * tasks
    for o in outcomes:
        correct[o.task] += o.reward >= solve_threshold
    out = summarize(outcomes, solve_threshold)
    out["samples"] = samples
    out["pass_at_k"] = {
        str(k): evalstats.pass_at_k_estimate(correct, samples, k).as_dict()
        for k in pass_ks(samples)
    }
    return out


def by_task(
    tasks: Sequence[Task],
    greedy: Sequence[Outcome],
    sampled: Sequence[Outcome],
    samples: int,
    solve_threshold: float,
) -> dict[str, TaskResult]:
    """A mixture's result per task (by label, `Task.kind`): each task's held-out split
    summarized alone, as the whole result is (its `n`, greedy and sampled figures and
    solve rate). The whole result pools them: every task's n episodes count alike."""
    out: dict[str, TaskResult] = {}
    for label in dict.fromkeys(t.kind for t in tasks):
        mine = [i for i, t in enumerate(tasks) if t.kind == label]
        index = {i: k for k, i in enumerate(mine)}  # pass@k counts tasks from 0
        g = summarize([o for o in greedy if o.task in index], solve_threshold)
        part_sampled = None
        if samples:
            own = [dataclasses.replace(o, task=index[o.task]) for o in sampled if o.task in index]
            part_sampled = summarize_sampled(own, len(mine), samples, solve_threshold)
        out[label] = {
            "n": len(mine),
            "greedy": g,
            "sampled": part_sampled,
            "solve_rate": g["solve_rate"]["value"],
        }
    return out


def split_digest(tasks: Sequence[Task]) -> str:
    """A short digest of the split's prompts and answers: equal digests, equal splits."""
    h = hashlib.sha256()
    for t in tasks:
        h.update(json.dumps([t.prompt, t.answer]).encode())
    return h.hexdigest()[:16]


# -- the policy ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedPolicy:
    chat: HFChat
    spec: ModelSpec
    params: PyTree
    source: str  # what was evaluated, in words
    step: int | None  # the trainer step (0: the initial policy; None: a checkpoint directory)


def load_policy(cfg: Config, checkpoint: Path | None, run_dir: Path | None) -> LoadedPolicy:
    """The policy of a checkpoint directory, or of `run_dir`'s newest complete checkpoint
    (EvalError when there is none, or its params do not fit the run's model), or with
    neither the policy a run of `cfg` starts from (its checkpoint, warm-started when
    `model.init` says so)."""
    from streamrl.chat.hf import HFChat
    from streamrl.model.checkpoint import load_checkpoint
    from streamrl.model.policy import starting_policy

    if checkpoint is not None:
        if not checkpoint.is_dir():
            raise EvalError(f"--checkpoint {checkpoint} does not exist")
        spec, params = load_checkpoint(checkpoint, _dtype(cfg))
        return LoadedPolicy(
            HFChat.for_model(checkpoint, cfg.model), spec, params, str(checkpoint), None
        )
    start = starting_policy(cfg, warm=run_dir is None)
    if run_dir is None:
        how = "warm-started" if cfg.model.init == "warmstart" else "as built"
        return LoadedPolicy(start.chat, start.spec, start.params, f"{start.source_dir} ({how})", 0)
    from streamrl import checkpoints as ckpts

    ck = ckpts.latest_complete(RunPaths(run_dir).checkpoints)
    if ck is None:
        raise EvalError(f"--run-dir {run_dir}: no complete checkpoint under {run_dir}/checkpoints")
    params = _trained_params(cfg, ck.state_dir, start.params)
    return LoadedPolicy(start.chat, start.spec, params, str(ck.path), ck.step)


def _dtype(cfg: Config) -> DType:
    from streamrl.model.checkpoint import policy_dtype

    return policy_dtype(cfg.model.dtype)


def _trained_params(cfg: Config, state_dir: Path, base: PyTree) -> PyTree:
    """The policy params in a trainer checkpoint's Orbax state (`base`: the run's model as
    its checkpoint has it, the layout they must have), LoRA adapters merged in."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from streamrl.model.lora import apply_lora, init_lora
    from streamrl.trainer.step import checkpoint_tree, lora_config, make_optimizer

    lora = lora_config(cfg.trainer)
    # The state's layout as the trainer builds it (shapes only), on this process's first
    # device: a checkpoint a trainer mesh wrote in shards restores here whole.
    trained = base if lora is None else jax.eval_shape(lambda b: init_lora(b, lora, 0), base)
    target = checkpoint_tree(
        trained,
        jax.eval_shape(make_optimizer(cfg.trainer).init, trained),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), target)
    checkpointer = ocp.StandardCheckpointer()
    try:
        tree = checkpointer.restore(state_dir.resolve(), abstract)
    except Exception as err:  # any mismatch of layout, a damaged file
        raise EvalError(
            f"{state_dir.parent}: cannot restore its trainer state with the run's model, "
            "optimizer and LoRA settings (evaluate with the run's config): "
            f"{type(err).__name__}: {err}"
        ) from None
    finally:
        checkpointer.close()
    params = tree["params"]
    if lora is not None:
        if cfg.model.init == "warmstart":  # the base the adapters trained on
            from streamrl.trainer.warmstart import warmstart_params

            base = warmstart_params(cfg)
        params = apply_lora(base, params, lora)
    if _layout(params) != _layout(base):
        raise EvalError(
            f"{state_dir.parent}: its params do not have the structure of the run's model; "
            "evaluate with the run's config"
        )
    return jax.tree.map(lambda x: jnp.asarray(x, _dtype(cfg)), params)


def _layout(tree: PyTree) -> list[tuple[str, tuple[int, ...]]]:
    """Each leaf's path and shape: what restored params must share with the model's."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(path), tuple(np.shape(x))) for path, x in leaves]


# -- running episodes ----------------------------------------------------------------------


class LocalCaller:
    """Tool calls of the episodes, run by the tool workers' job code in the sandbox
    runtime `evaluate` installs (no Redis, no ledger), on `threads` threads of their own."""

    def __init__(self, cfg: Config, threads: int) -> None:
        self.time_limit_s = cfg.tools.time_limit_s
        self.output_cap = cfg.tools.output_cap_bytes
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="eval-tool")

    async def call(self, name: str, arguments: str, call_id: str) -> ToolResult:
        from streamrl.tools.jobs import execute_call

        return await asyncio.get_running_loop().run_in_executor(
            self.pool,
            execute_call,
            call_id,
            name,
            arguments,
            self.time_limit_s,
            self.output_cap,
            WORKER,
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


async def run_pass(
    cfg: Config,
    policy: LoadedPolicy,
    tasks: Sequence[Task],
    members: int,
    greedy: bool,
    log: structlog.stdlib.BoundLogger,
) -> list[Outcome]:
    """Every task's `members` episodes on a fresh engine (greedy: top-k 1)."""

    from streamrl.model.engine import Engine
    from streamrl.rollout.engine_server import EngineServer, engine_config
    from streamrl.rollout.episode import EpisodeRunner
    from streamrl.tasks.registry import load_episodes

    r = cfg.rollout
    engine_cfg = engine_config(
        r,
        tuple(policy.chat.stop_ids),
        policy.chat.pad_id,
        greedy=greedy,
        num_slots=min(r.max_batch_size, r.max_concurrency, len(tasks) * members),
    )
    engine = Engine(policy.spec, policy.params, engine_cfg)
    server = EngineServer(engine, policy.step or 0, log)
    runner = EpisodeRunner(server, policy.chat.dialogue, r, cfg.run.seed, WORKER, log)
    # As many episodes at once as a rollout worker runs (rollout.max_concurrency), each
    # with a thread for its tool calls: an episode's env_step_timeout_s then measures its
    # tool call, not a queue no rollout worker would have.
    caller = LocalCaller(cfg, r.max_concurrency)
    episodes = load_episodes(cfg, caller)
    slots = asyncio.Semaphore(r.max_concurrency)

    async def one(index: int, task: Task, member: int) -> Outcome:
        agents: list[CountingAgent] = []

        def make() -> tuple[Agent, Environment]:
            agent, env = episodes.make(task, member)
            agents.append(CountingAgent(agent))
            return agents[-1], env

        async with slots:
            tr = await runner.run(task, member, make)
        return outcome(index, tr, agents[0] if agents else None)

    serving = asyncio.create_task(server.serve())
    try:
        return list(
            await asyncio.gather(
                *(one(i, t, m) for i, t in enumerate(tasks) for m in range(members))
            )
        )
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        caller.close()


def evaluate(
    cfg: Config,
    policy: LoadedPolicy,
    n: int,
    samples: int,
    solve_threshold: float,
    log: structlog.stdlib.BoundLogger,
) -> EvalResult:
    """The result of evaluating `policy` on the first `n` held-out tasks (module doc)."""
    from streamrl.tools.jobs import ToolRuntime, install, open_sandbox, uninstall
    from streamrl.tools.registry import load_tools

    start = time.monotonic()
    # A warm start of its own seed trained on that seed's prompts: not held out either.
    warm = (cfg.model_seed,) if cfg.model.init == "warmstart" else ()
    tasks = mixture_heldout_tasks(cfg.mixture, cfg.run.seed, n, max(samples, 1), warm)
    log.info("eval_start", policy=policy.source, tasks=n, samples=samples)
    # The tool workers' sandbox choice and tools, in this process (`LocalCaller`).
    tools = load_tools(cfg.tools)
    install(ToolRuntime(open_sandbox(cfg.tools, cfg.run.name, WORKER, log), tools))
    try:
        return _evaluate(cfg, policy, tasks, samples, solve_threshold, log, start)
    finally:
        uninstall()


def _evaluate(
    cfg: Config,
    policy: LoadedPolicy,
    tasks: list[Task],
    samples: int,
    solve_threshold: float,
    log: structlog.stdlib.BoundLogger,
    start: float,
) -> EvalResult:
    n = len(tasks)
    greedy = asyncio.run(run_pass(cfg, policy, tasks, 1, True, log))
    greedy_figures = summarize(greedy, solve_threshold)
    sampled = asyncio.run(run_pass(cfg, policy, tasks, samples, False, log)) if samples else []
    sampled_figures = summarize_sampled(sampled, n, samples, solve_threshold) if samples else None
    mixture: _MixtureTasks = {}
    if len(cfg.mixture) > 1:
        mixture["tasks"] = by_task(tasks, greedy, sampled, samples, solve_threshold)
    result: EvalResult = {
        "schema": RESULT_SCHEMA,
        "policy": policy.source,
        "step": policy.step,
        "task": cfg.mixture[0].label if len(cfg.mixture) == 1 else "mixture",
        "seed": cfg.run.seed,
        "n": n,
        "samples": samples,
        "solve_threshold": solve_threshold,
        "split": {"first_cursor": HELDOUT_CURSOR, "digest": split_digest(tasks)},
        "greedy": greedy_figures,
        "sampled": sampled_figures,
        "solve_rate": greedy_figures["solve_rate"]["value"],
        **mixture,
        "elapsed_s": round(time.monotonic() - start, 3),
    }
    log.info("eval_done", solve_rate=result["solve_rate"], elapsed_s=result["elapsed_s"])
    return result


# -- the gate ------------------------------------------------------------------------------


def read_baseline(path: Path) -> JSONObject:
    """A stored `streamrl eval --json` result (EvalError when it is not one)."""
    try:
        data = json.loads(path.read_text())
        rate = float(data["solve_rate"])
        str(data["task"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise EvalError(f"--gate {path}: not a `streamrl eval --json` result: {err}") from None
    if not isinstance(data, dict):
        raise EvalError(f"--gate {path}: not a `streamrl eval --json` result")
    if not 0.0 <= rate <= 1.0:  # NaN too (review N21: a NaN baseline passed every policy)
        raise EvalError(f"--gate {path}: solve_rate {data['solve_rate']!r} is not in [0, 1]")
    return data


def gate_result(
    result: Mapping[str, object], baseline: JSONObject, tolerance: float
) -> evalstats.GateVerdict:
    """The gate's verdict on `result` (this run's, `EvalResult`) against `baseline`
    (`read_baseline`'s; EvalError for another task)."""
    if baseline["task"] != result["task"]:
        raise EvalError(
            f"--gate: the baseline evaluated task {baseline['task']!r}, this run "
            f"{result['task']!r}: not comparable"
        )
    # Review N21: a baseline of another split or threshold, or of more tasks than this run
    # evaluates (whose wide interval lets real regressions pass), is no baseline for it.
    for what, ours, theirs in (
        ("split", _get(result, "split", "digest"), _get(baseline, "split", "digest")),
        ("solve_threshold", result.get("solve_threshold"), baseline.get("solve_threshold")),
    ):
        if theirs is not None and ours != theirs:
            raise EvalError(f"--gate: the baseline's {what} is {theirs!r}, this run's {ours!r}")
    ours_n, theirs_n = result["n"], baseline.get("n")
    if isinstance(theirs_n, int) and isinstance(ours_n, int) and ours_n < theirs_n:
        raise EvalError(
            f"--gate: this run evaluates {ours_n} tasks, the baseline {theirs_n}: "
            "evaluate at least as many (--n)"
        )
    s = _get(result, "greedy", "solve_rate")
    if not isinstance(s, dict):
        raise EvalError("--gate: this run's result has no greedy solve rate")
    current = evalstats.Estimate(s["value"], s["lo"], s["hi"], s["n"])
    return evalstats.gate(current, number(baseline["solve_rate"]), tolerance)


def _get(data: object, *path: str) -> object:
    """`data[path[0]][path[1]]...` of nested JSON objects, None where one is missing."""
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def render(result: EvalResult) -> str:
    """The result as lines for a person."""

    def est(e: Figure | None, pct: bool = True) -> str:
        if e is None:
            return "n/a (no tool calls)"
        if pct:
            return f"{e['value']:.3f}  [{e['lo']:.3f}, {e['hi']:.3f}]"
        return f"{e['value']:.2f}  [{e['lo']:.2f}, {e['hi']:.2f}]"

    lines = [
        f"policy {result['policy']}"
        + (f" (trainer step {result['step']})" if result["step"] is not None else ""),
        f"task {result['task']}: {result['n']} held-out tasks "
        f"(split {result['split']['digest']}), 95% intervals in brackets",
    ]
    for name, p in (("greedy", result["greedy"]), ("sampled", result["sampled"])):
        if p is None:
            continue
        head = name if name == "greedy" else f"sampled, {p['samples']} per task"
        lines.append(f"{head} ({p['episodes']} episodes):")
        lines.append(f"  solve rate          {est(p['solve_rate'])}")
        for k, e in p.get("pass_at_k", {}).items():
            lines.append(f"  pass@{k:<14} {est(e)}")
        lines.append(f"  mean reward         {est(p['reward_mean'])}")
        lines.append(f"  well-formed calls   {est(p['tool_call_wellformed_rate'])}")
        lines.append(f"  truncated           {est(p['truncation_rate'])}")
        lines.append(f"  errors              {est(p['error_rate'])}")
        lines.append(f"  mean turns          {est(p['turns_mean'], False)}")
        lines.append(f"  mean tokens         {est(p['tokens_mean'], False)}")
    return "\n".join(lines)
