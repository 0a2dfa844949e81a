"""How many threads XLA's CPU backend runs one program on (`STREAMRL_XLA_CPU_THREADS`).

XLA:CPU splits each program's larger ops over an intra-op thread pool as wide as the CPUs
the process may run on, and offers no flag to narrow it. On a host whose cores are all
busy anyway (the trainer, the rollout engine and the evaluator of a CPU run side by side,
or a test suite running two test processes), the split buys no speed and costs CPU: a
warm-start step of the tiny model took 161 ms of CPU on two threads against 134 ms on
one (95 against 134 ms of wall time with the other core idle).

`narrow_xla_cpu_threads(n)` sizes the pool at n: the pool takes its width from the
process's CPU affinity when the backend starts, so the process is confined to n CPUs while
JAX starts its CPU backend (JAX's own factory for it, wrapped once JAX loads: importing
JAX earlier than the process would lengthen its start, which the launcher's liveness
limit counts), and then every thread of it is given all its CPUs again (the pool keeps n
threads; the kernel may still move them to any core). Called where a process starts,
before anything uses JAX: the `streamrl` commands that run models
(`streamrl_workers.cli.main`), `ops/prewarm.py`, and the test
processes (tests/conftest.py; `make test` sets it to 1).
Unset (the default), nothing changes. No effect on a backend that is already running or
on accelerators (their programs do not run on the host's threads).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

ENV = "STREAMRL_XLA_CPU_THREADS"


def threads_from_env() -> int | None:
    """STREAMRL_XLA_CPU_THREADS as a count; None when unset or empty. ValueError names the
    variable when it is not a positive whole number."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={raw!r}: expected a positive whole number of threads")
    return n


def narrow_xla_cpu_threads(n: int) -> bool:
    """Have JAX start its CPU backend, whenever it does, with an intra-op pool of
    min(n, CPUs) threads, then give every thread of the process its CPUs back.

    Imports nothing: when JAX is not loaded yet, the wrap waits for JAX's own import of
    `jax._src.xla_bridge` (a process that never loads JAX pays nothing, and one that does
    pays no earlier). False (and nothing changed) when the backend already runs or this
    JAX registers its CPU backend otherwise than the pinned version does."""
    bridge = sys.modules.get(_BRIDGE)
    if bridge is not None:
        return _wrap_cpu_factory(bridge, n)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(n))
    return True


_BRIDGE = "jax._src.xla_bridge"


def _wrap_cpu_factory(bridge: ModuleType, n: int) -> bool:
    factories = getattr(bridge, "_backend_factories", None)
    registration = factories.get("cpu") if isinstance(factories, dict) else None
    if registration is None or "cpu" in getattr(bridge, "_backends", {}):
        return False
    factory = registration.factory

    def narrowed() -> object:
        cpus = os.sched_getaffinity(0)
        os.sched_setaffinity(0, sorted(cpus)[: min(n, len(cpus))])
        try:
            return factory()
        finally:
            for tid in os.listdir("/proc/self/task"):
                # a thread that ended meanwhile has nothing to give back
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.sched_setaffinity(int(tid), cpus)

    registration.factory = narrowed
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps the CPU backend's factory once `jax._src.xla_bridge` has run (it registers
    the factory as it loads)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _BRIDGE:
            return None
        sys.meta_path.remove(self)  # once; the other finders find the module itself
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader, n = spec.loader, self.n
        exec_module = loader.exec_module

        def exec_then_wrap(module: ModuleType) -> None:
            exec_module(module)
            _wrap_cpu_factory(module, n)

        loader.exec_module = exec_then_wrap  # type: ignore[method-assign]
        return spec


def narrow_from_env() -> bool:
    """`narrow_xla_cpu_threads` by STREAMRL_XLA_CPU_THREADS; False (nothing done) when unset."""
    n = threads_from_env()
    return False if n is None else narrow_xla_cpu_threads(n)
