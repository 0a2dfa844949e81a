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
    at least 0: the age it had against the restored state. `earlier`: the jumps of the
    resumes before (size, since), oldest first: a turn sampled before several resumes is
    judged with each jump after it taken out (two restarts a few steps apart otherwise
    aged the groups of the first restart's lineage by the first jump)."""

    version: int
    offset: int = 0
    since: int = 0
    earlier: tuple[tuple[int, int], ...] = ()

    def _jumps(self) -> tuple[tuple[int, int], ...]:
        return (*self.earlier, (self.offset, self.since)) if self.offset else self.earlier

    def _lineage(self, v: int) -> int:
        """`v` less every jump at or before it: versions as if no resume had jumped."""
        return v - sum(size for size, since in self._jumps() if since <= v)

    def age(self, v: int) -> int:
        return max(0, self._lineage(self.version) - self._lineage(v))

    def resumed(self, version: int, jump: int, keep: int = 32) -> PolicyClock:
        """The clock after a resume that took `version`, `jump` past its restored state's
        (the jump before it kept, unless it is this resume's again: a restart that
        published nothing; the newest `keep` jumps)."""
        jumps = [j for j in self._jumps() if j[1] != version]
        return PolicyClock(version, jump, version, tuple(jumps[-(keep - 1) :] if keep > 1 else ()))

    def encode(self) -> str:
        """As `Keys.policy_offset` holds it: "size:since" per jump, oldest first."""
        return ",".join(f"{size}:{since}" for size, since in self._jumps()) or "0:0"

    def __str__(self) -> str:
        jumped = f" ({self.offset} jumped by a resume at {self.since})" if self.offset else ""
        return f"{self.version}{jumped}"


TrainerVersion = int | PolicyClock  # a plain version: no resume jump


def clock_of(trainer_version: TrainerVersion) -> PolicyClock:
    if isinstance(trainer_version, PolicyClock):
        return trainer_version
    return PolicyClock(trainer_version)


def policy_clock(version: bytes | str | None, offset: bytes | str | None) -> PolicyClock:
    """The clock from `Keys.policy_version` and `Keys.policy_offset` ("size:since" per
    resume jump, oldest first, set by a resumed trainer; absent: no jump) as Redis holds
    them."""
    raw = offset.decode() if isinstance(offset, bytes) else offset
    jumps = []
    for part in (raw or "").split(","):
        size, _, since = part.partition(":")
        if size and int(size):
            jumps.append((int(size), int(since or 0)))
    if not jumps:
        return PolicyClock(int(version or 0))
    (offset_, since_), earlier = jumps[-1], tuple(jumps[:-1])
    return PolicyClock(int(version or 0), offset_, since_, earlier)
