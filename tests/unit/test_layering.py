"""The layering rules of DESIGN.md, checked on the real import graph."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "transformers", "torch")

LIGHT_MODULES = [
    "streamrl.config",
    "streamrl.wire",
    "streamrl.names",
    "streamrl.transport",
    "streamrl.counters",
    "streamrl.grouper",
    "streamrl.grouper.scoring",
    "streamrl.feeder",
    # what `streamrl up` and the operator tools run in: they start no model
    "streamrl.run.launcher",
    "streamrl.run.summary",
    "streamrl.run.supervise",
    "streamrl.checkpoints",
    "streamrl.queues",
    "streamrl.run.runtime",
    "streamrl.tools.client",
    "streamrl.tools.jobs",
    # the weight channel, and the rollout worker of the stub policy (the fault, launcher and
    # orchestration tests, the benchmarks): the engine, its sampling and the weight loader
    # are imported only for the transformer policy (JAX's import was 3 of the stub worker's
    # 4.8 CPU seconds of start-up, paid again at each of its restarts)
    "streamrl.weightsync",
    "streamrl_workers.rollout",
    "streamrl.rollout.stub",
    "streamrl.rollout.weights",
    "streamrl.rollout.episode",
    "streamrl.rollout.worker",
    "streamrl.model.requests",
    "streamrl.obs.metrics",
    "streamrl.obs.status",
    # the sinks worker: tensorboardX and wandb only once a sink opens
    "streamrl.obs.sinks",
    "streamrl.obs.sink_backends",
    "streamrl_workers.sinks",
    "streamrl_workers.statuscli",
    "streamrl_workers.cli",
    "streamrl_workers.grouper",
    "streamrl_workers.tools",
    "streamrl_workers.feeder",
    # the plug-in API: a user's tool module imports it in the tool workers
    "streamrl.api",
    "streamrl.plugins",
    "streamrl.tasks.registry",
    "streamrl.tasks.synthetic",
    "unitconv.task",
    "unitconv.tools",
]


def _imported(modules: list[str]) -> set[str]:
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    return set(out.split())


def test_light_workers_import_no_model_stack() -> None:
    loaded = _imported(LIGHT_MODULES)
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert heavy == []


def test_the_rollout_tool_client_imports_no_sandbox() -> None:
    """The rollout worker's tool client names the rq job by a constant: it does not pull
    the job's module, with the sandboxes and the docker SDK, into every rollout worker."""
    loaded = _imported(["streamrl.tools.client"])
    assert not {"docker", "streamrl.tools.jobs", "streamrl.tools.containers"} & loaded
    from streamrl.tools import JOB_PATH
    from streamrl.tools.jobs import run_tool_call

    assert f"{run_tool_call.__module__}.{run_tool_call.__qualname__}" == JOB_PATH


def test_rl_math_imports_no_redis() -> None:
    loaded = _imported(["streamrl.rl.advantages", "streamrl.rl.losses"])
    assert not any(m.split(".")[0] in ("redis", "rq") for m in loaded)


def _imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_packages_never_import_workers() -> None:
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "packages").rglob("*.py")
        if any(n.startswith("streamrl_workers") for n in _imports_of(p))
    ]
    assert offenders == []


def test_trainer_and_rollout_meet_only_through_streams() -> None:
    pkg = REPO / "packages" / "streamrl"
    for side, other in (("trainer", "streamrl.rollout"), ("rollout", "streamrl.trainer")):
        for p in (pkg / side).rglob("*.py"):
            assert not any(n.startswith(other) for n in _imports_of(p)), p
    for p in (pkg / "tools").rglob("*.py"):  # the sandbox side never sees the policy
        assert not any(n.startswith("streamrl.model") for n in _imports_of(p)), p


def test_the_trainer_package_does_not_import_the_process_runtime() -> None:
    """Code review row 18: trainer/cluster.py imported streamrl.run.runtime (a worker
    process's context, its Redis client and logging) for one constant, the coordinator's
    environment variable. The trainer's library code takes nothing from the process layer;
    the constant lives in streamrl.trainer, which the launcher reads."""
    pkg = REPO / "packages" / "streamrl" / "trainer"
    offenders = [
        str(p.relative_to(REPO))
        for p in pkg.rglob("*.py")
        if "streamrl.run.runtime" in _imports_of(p)
    ]
    assert offenders == []
