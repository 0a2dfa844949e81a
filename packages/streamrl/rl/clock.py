"""Policy age across trainer restarts (review N1): the trainer's version a trajectory's age
is judged against, less the versions a resumed trainer's first publish jumped past its
restored state. Pure: the grouper and the trainer judge with the same rule."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PolicyClock", "TrainerVersion", "clock_of", "policy_clock"]


@dataclass(frozen=True)
class PolicyClock:
    """The trainer's version as policy age is judged against (review N1). A resumed
    trainer publishes its restored state as a version above every one published (`since`,
    the first of its lineage), `offset` versions past the state's own: that jump is no
    age. A turn of the current lineage (version >= since) is `version - v` old; an older
    one (the common ancestry, or a lineage the restore discarded) `version - offset - v`,
    at least 0: the age it had against the restored state."""

    version: int
    offset: int = 0
    since: int = 0

    def age(self, v: int) -> int:
        if v >= self.since:
            return self.version - v
        return max(0, self.version - self.offset - v)

    def __str__(self) -> str:
        jumped = f" ({self.offset} jumped by a resume at {self.since})" if self.offset else ""
        return f"{self.version}{jumped}"


TrainerVersion = int | PolicyClock  # a plain version: no resume jump


def clock_of(trainer_version: TrainerVersion) -> PolicyClock:
    if isinstance(trainer_version, PolicyClock):
        return trainer_version
    return PolicyClock(trainer_version)


def policy_clock(version: bytes | str | None, offset: bytes | str | None) -> PolicyClock:
    """The clock from `Keys.policy_version` and `Keys.policy_offset` ("offset:since", set
    by a resumed trainer; absent: no jump) as Redis holds them."""
    raw = offset.decode() if isinstance(offset, bytes) else offset
    jump, _, since = (raw or "0:0").partition(":")
    return PolicyClock(int(version or 0), int(jump or 0), int(since or 0))
