"""Whether a config's settings fit each other: the values it implies, and the combinations
that would throw away most of their own work as stale (issue 29, item 2).

Pure arithmetic on the config (no Redis, no JAX). `streamrl up --explain` prints `explain`;
`streamrl up` and every worker refuse a config for which `problems` is not empty
(`check_fit`), with the arithmetic in the message.

The model. W rollout workers of C episode slots each, groups of G episodes, the trainer
taking B groups a step and publishing every P steps, a trajectory dropped when its oldest
turn is more than K versions behind the trainer (`grouper.off_policy_steps`), rollout
pausing while R groups wait for the trainer (`rollout.max_ready_groups`).

- Rollout the limit (the trainer keeps up): W x C / G groups are in flight; about as many
  end while one of them runs, so the trainer takes W x C / (G x B) steps meanwhile. A group
  reaches the trainer about that many versions behind, plus (P - 1) / 2 on average for the
  version rollout serves lagging the trainer's between publishes. Above K + 1, the typical
  group is dropped: most of the run's work is wasted whatever the machine. Refused.
- Trainer the limit: groups queue up to R before rollout pauses; a group that starts then
  waits behind the R ready and the groups in flight: (W x C / G + R) / B versions. Above
  K + 1, the groups at the back of a full queue are dropped when their turn comes. Only
  said (`warnings`): a run whose trainer keeps up never fills the queue, and a lower
  R costs nothing but a pause.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from streamrl.capacity import auto_backlog
from streamrl.config import Config, ConfigError

__all__ = ["Fit", "check_fit", "fit", "fit_live"]


@dataclass(frozen=True)
class Fit:
    """The values a config implies (see the module docstring for the model)."""

    mode: str  # rollout.mode
    colocated: bool  # run.colocated: rollout and training alternate, no lag to speak of
    workers: int  # W: rollout workers (1 when colocated)
    slots: float  # C: episode slots per worker (rollout.max_concurrency; live: their mean)
    group_size: int  # G: rollout.num_generations
    groups_per_step: int  # B: trainer.groups_per_step
    publish_every: int  # P: trainer.publish_every
    staleness_bound: int  # K: grouper.off_policy_steps
    ready_cap: int  # R: rollout.max_ready_groups
    backlog: int  # tasks the feeder keeps written ahead (auto: for W workers of C slots)
    backlog_auto: bool  # task.max_backlog = "auto"
    derived: tuple[str, ...] = ()  # the fields the config derived ("auto": Config.derived)
    admission_cap: int = 0  # rollout.max_concurrency = "auto": its cap (slots: the estimate)

    @property
    def groups_in_flight(self) -> float:
        """W x C / G."""
        return self.workers * self.slots / self.group_size

    @property
    def publish_lag(self) -> float:
        """(P - 1) / 2: versions the served policy lags the trainer's, on average."""
        return (self.publish_every - 1) / 2

    @property
    def lag_rollout_bound(self) -> float:
        """Versions behind when a group reaches the trainer, rollout the limit."""
        return self.groups_in_flight / self.groups_per_step + self.publish_lag

    @property
    def lag_trainer_bound(self) -> float:
        """Versions behind for the last of a full ready queue, the trainer the limit."""
        queued = self.groups_in_flight + self.ready_cap
        return queued / self.groups_per_step + self.publish_lag

    @property
    def checked(self) -> bool:
        """Whether staleness applies: async mode, rollout and trainer apart."""
        return self.mode == "async" and not self.colocated

    @property
    def limit(self) -> int:
        """K + 1: beyond this lag the typical group is dropped."""
        return self.staleness_bound + 1

    def _room(self) -> float:
        return self.limit - self.publish_lag  # versions a group may spend in flight

    def problems(self) -> list[str]:
        """What makes this config drop most of its own work as stale; empty: it fits."""
        if not self.checked or self.lag_rollout_bound <= self.limit:
            return []
        w, c, g, b = self.workers, self.slots, self.group_size, self.groups_per_step
        lag = f"{self.groups_in_flight:g} / {b} = {self.groups_in_flight / b:g}"
        if self.publish_every > 1:
            lag += f", + (trainer.publish_every - 1) / 2 = {self.publish_lag:g}"
        fixes = []
        room = self._room()
        if room > 0:
            fixes.append(f"trainer.groups_per_step >= {math.ceil(w * c / (g * room))}")
            if math.floor(room * g * b / w) >= 1:
                fixes.append(f"rollout.max_concurrency <= {math.floor(room * g * b / w)}")
        fixes.append(f"grouper.off_policy_steps >= {math.ceil(self.lag_rollout_bound - 1)}")
        return [
            "most groups would be dropped as stale: rollout.num_workers x "
            f"rollout.max_concurrency / rollout.num_generations = {w} x {c} / {g} = "
            f"{self.groups_in_flight:g} groups in flight, so about {self.lag_rollout_bound:g} "
            f"trainer steps pass while one runs (in flight / trainer.groups_per_step: {lag}), "
            f"above grouper.off_policy_steps + 1 = {self.limit}; set one of: " + ", ".join(fixes)
        ]

    def warnings(self) -> list[str]:
        """What fits, but wastes work in some regime."""
        if not self.checked or self.lag_trainer_bound <= self.limit:
            return []
        fits = math.floor(self.groups_per_step * self._room() - self.groups_in_flight)
        cap = (
            f"rollout.max_ready_groups <= {fits} keeps them"
            if fits >= 1
            else "no rollout.max_ready_groups keeps them (raise grouper.off_policy_steps)"
        )
        return [
            f"when the trainer is the limit, a group waits behind up to "
            f"rollout.max_ready_groups = {self.ready_cap} ready groups and "
            f"{self.groups_in_flight:g} in flight: {self.lag_trainer_bound:g} versions, above "
            f"grouper.off_policy_steps + 1 = {self.limit}, and is dropped; {cap}"
        ]

    def _auto(self, value: int, name: str) -> str:
        return f"{value} (auto)" if name in self.derived else str(value)

    def explain(self) -> str:
        """The derived values, one a line, then the problems and warnings."""
        mode = self.mode + (", colocated" if self.colocated else "")
        backlog = f"{self.backlog} ({'auto' if self.backlog_auto else 'task.max_backlog'})"
        rows = [
            ("mode", mode),
            (
                "rollout workers x slots",
                f"{self.workers} x {self.slots} = {self.workers * self.slots} episodes"
                + (
                    f" (auto admission, cap {self.admission_cap}: about the KV pool)"
                    if self.admission_cap
                    else ""
                ),
            ),
            ("groups in flight", f"{self.groups_in_flight:g} (groups of {self.group_size})"),
            ("task backlog", backlog),
            ("groups a trainer step", self._auto(self.groups_per_step, "trainer.groups_per_step")),
            ("policy lag, rollout the limit", f"{self.lag_rollout_bound:g} versions"),
            (
                "policy lag, trainer the limit",
                f"{self.lag_trainer_bound:g} versions "
                f"({self._auto(self.ready_cap, 'rollout.max_ready_groups')} ready groups at most)",
            ),
            (
                "staleness bound",
                f"{self.staleness_bound} (dropped beyond {self.staleness_bound} versions behind)",
            ),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value}" for name, value in rows]
        if not self.checked:
            lines.append("staleness: not checked (sync or colocated: every group on policy)")
        lines += [f"REFUSED: {p}" for p in self.problems()]
        lines += [f"warning: {w}" for w in self.warnings()]
        if self.checked and not self.problems() and not self.warnings():
            lines.append("fits: no regime drops most of its work as stale")
        return "\n".join(lines)


def fit(cfg: Config) -> Fit:
    """The values `cfg` implies."""
    r = cfg.rollout
    workers = cfg.rollout_workers
    auto = cfg.task.max_backlog == "auto"
    slots = cfg.concurrency_estimate  # max_concurrency, or what auto admission expects
    backlog = (
        auto_backlog([slots] * workers, r.num_generations) if auto else int(cfg.task.max_backlog)
    )
    return Fit(
        mode=r.mode,
        colocated=cfg.run.colocated,
        workers=workers,
        slots=slots,
        group_size=r.num_generations,
        groups_per_step=cfg.trainer.groups_per_step,
        publish_every=cfg.trainer.publish_every,
        staleness_bound=cfg.grouper.off_policy_steps,
        ready_cap=r.max_ready_groups,
        backlog=backlog,
        backlog_auto=auto,
        derived=cfg.derived,
        admission_cap=r.max_concurrency if r.admission == "auto" else 0,
    )


def fit_live(cfg: Config, slots: Sequence[int]) -> Fit:
    """What `cfg` implies with the rollout workers that are live, each with its advertised
    slots (`streamrl.capacity.live_slots`), instead of `rollout.num_workers`: workers scaled
    with compose (`--scale rollout=N`) are invisible to the config. Workers of different
    slots count as that many workers of their mean (the groups in flight are exact)."""
    f = fit(cfg)
    live = [c for c in slots if c > 0]
    if not live or f.colocated:
        return f
    mean = sum(live) / len(live)
    return replace(f, workers=len(live), slots=round(mean) if mean.is_integer() else mean)


def check_fit(cfg: Config) -> Fit:
    """`fit(cfg)`, or ConfigError naming the fields and the arithmetic when it drops most
    of its own work as stale."""
    f = fit(cfg)
    problems = f.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    return f
