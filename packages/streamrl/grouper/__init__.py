"""The grouper worker: group assembly and GRPO advantages, atomic in Redis, so any number of
groupers can run.

- `assembly`: `Grouper`, the worker's loop (add members, emit or drop complete groups, the
  waiting-groups gauge for rollout's backpressure);
- `scoring`: the pure rule for what a group gets (`score`), with `Outcome` and `Decision`;
- `timeouts`: groups past `group_timeout_s`, and complete groups never emitted;
- `scripts` and lua/: the Lua scripts, each with its KEYS and ARGV written in it.
"""

from streamrl.grouper.assembly import Grouper
from streamrl.grouper.scoring import EMITTED, Decision, Outcome, build_group, score

__all__ = ["EMITTED", "Decision", "Grouper", "Outcome", "build_group", "score"]
