"""The processes of one logical trainer: one (the default) or several under `jax.distributed`.

With several (`trainer.num_processes`), process 0 is the leader: it alone talks to Redis
(reads groups, records metrics, publishes weights, acknowledges, snapshots the queues),
builds each batch and broadcasts it; every process runs the same jitted step on its part
of the mesh, and joins the collectives of the hooks (gathering the parameters to publish
or export, writing its shards of the Orbax checkpoint). Every process learns from the
leader whether to go on, so all stop at the same step.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from streamrl.errors import FatalError
from streamrl.model.spec import PyTree
from streamrl.trainer import COORDINATOR_ENV


class ClusterError(RuntimeError):
    pass


class SecondTrainerError(FatalError):
    """This process is not one of the run's trainer: that index is outside the trainer's
    processes (another trainer holds the ones inside)."""


def init_distributed(num_processes: int, process_id: int) -> None:
    """Join the trainer's processes (no-op for one). The coordinator address comes from
    STREAMRL_COORDINATOR (`streamrl up` sets it; compose sets it per service)."""
    if not 0 <= process_id < num_processes:
        # Review N13: a second trainer (`--scale trainer=2`, or a new container while the
        # old one still holds index 0) claims index 1 and is refused here, before it
        # rewinds the first one's consumer group or writes into its checkpoints.
        raise SecondTrainerError(
            f"trainer process index {process_id} is outside 0..{num_processes - 1} "
            f"(trainer.num_processes = {num_processes}): another trainer of this run holds "
            "the index this one would need; a run has one trainer (of num_processes "
            "processes), so this one refuses to start"
        )
    if num_processes <= 1:
        return
    address = os.environ.get(COORDINATOR_ENV, "")
    if not address:
        raise ClusterError(
            f"trainer.num_processes is {num_processes}: set {COORDINATOR_ENV}=host:port "
            "(process 0's address) for every trainer process"
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts only
    jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id)
    # The backends exchange their topologies on first use, each process waiting for all:
    # do it now, while no process holds a lock another needs (a cache lock, say).
    jax.devices()


class Cluster:
    """Collectives among the trainer's processes; trivial with one."""

    def __init__(self) -> None:
        self.count = jax.process_count()
        self.index = jax.process_index()

    @property
    def leader(self) -> bool:
        return self.index == 0

    def broadcast(self, tree: PyTree) -> PyTree:
        """The leader's value of `tree` on every process (others pass same-shaped ones)."""
        if self.count == 1:
            return tree
        return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))

    def broadcast_arrays(self, arrays: list[np.ndarray] | None) -> list[np.ndarray]:
        """The leader's arrays on every process; the others pass None (their shapes and
        dtypes come first, in a small broadcast of their own)."""
        if self.count == 1:
            assert arrays is not None
            return arrays
        n = int(self.broadcast(np.array([len(arrays) if arrays is not None else 0]))[0])
        width = 8
        header = np.zeros((n, width + 1), np.int64)
        dtypes: list[np.dtype] = [np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint8)]
        if arrays is not None:
            for i, a in enumerate(arrays):
                if a.ndim > width or a.dtype not in dtypes:
                    raise ClusterError(f"cannot broadcast a {a.dtype} array of rank {a.ndim}")
                header[i, 0] = dtypes.index(a.dtype)
                header[i, 1 : 1 + a.ndim] = a.shape
                header[i, 1 + a.ndim :] = -1
        header = self.broadcast(header)
        if arrays is None:
            arrays = [
                np.zeros(tuple(int(d) for d in row[1:] if d >= 0), dtypes[int(row[0])])
                for row in header
            ]
        return list(self.broadcast(arrays))

    def gather(self, tree: PyTree) -> PyTree:
        """Every leaf whole, as NumPy, on every process (sharded leaves are collected)."""
        if self.count == 1:
            return tree
        return multihost_utils.process_allgather(tree, tiled=True)

    def barrier(self, name: str) -> None:
        if self.count > 1:
            multihost_utils.sync_global_devices(name)


def scalar(x: jax.Array | float) -> float:
    """A replicated scalar result of the step as a float, on any process."""
    if hasattr(x, "addressable_data"):
        return float(np.asarray(x.addressable_data(0)))
    return float(x)
