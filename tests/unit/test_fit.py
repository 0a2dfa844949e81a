"""streamrl.fit: the values a config implies and the combinations refused, worked by hand."""

from collections.abc import Mapping

import pytest

from streamrl.config import Config, ConfigError, parse_config
from streamrl.fit import check_fit, fit, fit_live


def cfg(**sections: Mapping[str, object]) -> Config:
    return parse_config({k: dict(v) for k, v in sections.items()})


def test_the_issue_29_combination_is_refused_with_its_arithmetic_and_fixes() -> None:
    # C 64, G 4, B 4, K 2: 64 / 4 = 16 groups in flight; 16 / 4 = 4 steps while one runs,
    # above K + 1 = 3. Fixes: B >= ceil(64 / (4 x 3)) = 6 (16 / 6 = 2.67), C <= 3 x 4 x 4 = 48
    # (12 / 4 = 3), K >= 4 - 1 = 3 (limit 4).
    old = {"groups_per_step": 4}  # the defaults before they were derived
    c = cfg(rollout={"max_concurrency": 64}, trainer=old, grouper={"off_policy_steps": 2})
    f = fit(c)
    assert (f.groups_in_flight, f.lag_rollout_bound, f.limit) == (16, 4, 3)
    with pytest.raises(ConfigError) as err:
        check_fit(c)
    msg = str(err.value)
    assert "1 x 64 / 4 = 16 groups in flight" in msg and "16 / 4 = 4" in msg
    for fix in ("trainer.groups_per_step >= 6", "rollout.max_concurrency <= 48",
                "grouper.off_policy_steps >= 3"):  # fmt: skip
        assert fix in msg, msg
    k2 = {"off_policy_steps": 2}
    check_fit(cfg(rollout={"max_concurrency": 64}, trainer={"groups_per_step": 6}, grouper=k2))
    check_fit(cfg(rollout={"max_concurrency": 64}, trainer=old, grouper={"off_policy_steps": 3}))
    check_fit(cfg(rollout={"max_concurrency": 48}, trainer=old, grouper=k2))
    with pytest.raises(ConfigError):  # 13 / 4 = 3.25
        check_fit(cfg(rollout={"max_concurrency": 52}, trainer=old, grouper=k2))
    # The defaults now derive B from C: 64 / 4 = 16 groups a step, one wave, lag 1; the
    # ready cap two steps, 32; the same at C 256 (B 64, R 128) and for 2 workers of 128.
    for rollout in ({"max_concurrency": 64}, {"max_concurrency": 256},
                    {"max_concurrency": 128, "num_workers": 2}):  # fmt: skip
        f = check_fit(cfg(rollout=rollout))
        assert f.lag_rollout_bound == 1 and f.lag_trainer_bound == 3 and f.warnings() == []
    f = fit(cfg(rollout={"max_concurrency": 64}))
    assert (f.groups_per_step, f.ready_cap, f.staleness_bound) == (16, 32, 8)


def test_derived_fields_follow_the_others_and_a_number_still_wins() -> None:
    # "auto" (or 0, or left out): B = ceil(W x C / G), R = 2 B; colocated counts one worker.
    c = cfg()
    assert (c.trainer.groups_per_step, c.rollout.max_ready_groups) == (4, 8)
    assert c.derived == ("trainer.groups_per_step", "rollout.max_ready_groups")
    c = cfg(rollout={"max_concurrency": 10, "num_generations": 4, "num_workers": 3})
    assert (c.trainer.groups_per_step, c.rollout.max_ready_groups) == (8, 16)  # ceil(7.5)
    c = cfg(run={"colocated": True}, rollout={"max_concurrency": 10, "num_workers": 3},
            trainer={"groups_per_step": "auto"}, )  # fmt: skip
    assert c.trainer.groups_per_step == 3  # ceil(10 / 4)
    c = cfg(trainer={"groups_per_step": 6}, rollout={"max_ready_groups": 0})
    assert (c.trainer.groups_per_step, c.rollout.max_ready_groups) == (6, 12)
    assert c.derived == ("rollout.max_ready_groups",)
    c = cfg(trainer={"groups_per_step": 6}, rollout={"max_ready_groups": 5})
    assert c.derived == () and c.rollout.max_ready_groups == 5
    with pytest.raises(ConfigError, match="groups_per_step"):
        cfg(trainer={"groups_per_step": "many"})


def test_the_defaults_fit_and_say_what_a_full_ready_queue_costs() -> None:
    # C 16, G 4, B auto 4, K 8, R auto 8: 4 in flight, lag 1 with rollout the limit, and
    # (4 + 8) / 4 = 3 with the trainer the limit: fits. Backlog auto: 16 + 2 x ceil(16 / 4)
    # = 24. R 64 by hand: (4 + 64) / 4 = 17 versions, above K + 1 = 9: a warning, and
    # R <= 4 x 9 - 4 = 32 keeps them ((4 + 32) / 4 = 9).
    f = check_fit(cfg())
    assert (f.groups_in_flight, f.lag_rollout_bound, f.lag_trainer_bound) == (4, 1, 3)
    assert (f.backlog, f.backlog_auto) == (24, True)
    assert f.problems() == [] and f.warnings() == []
    text = f.explain()
    assert "1 x 16 = 16 episodes" in text and "24 (auto)" in text and "4 (auto)" in text
    assert "fits:" in text
    [warning] = fit(cfg(rollout={"max_ready_groups": 64})).warnings()
    assert "17 versions" in warning and "rollout.max_ready_groups <= 32 keeps them" in warning
    assert fit(cfg(rollout={"max_ready_groups": 32})).warnings() == []


def test_workers_and_publish_lag_count() -> None:
    # 2 workers x 128 / 4 = 64 in flight; B 32: 2 versions; P 3 adds (3 - 1) / 2 = 1.
    f = fit(cfg(rollout={"num_workers": 2, "max_concurrency": 128},
                trainer={"groups_per_step": 32, "publish_every": 3}))  # fmt: skip
    assert (f.groups_in_flight, f.lag_rollout_bound) == (64, 3)
    assert f.problems() == [] and f.backlog == 2 * (128 + 2 * 32)
    # K 0 with P 3: 1 + 1 = 2 > 1, and no B or C gets a group under 1 - 1 = 0 versions.
    with pytest.raises(ConfigError) as err:
        check_fit(cfg(grouper={"off_policy_steps": 0}, trainer={"publish_every": 3}))
    assert "grouper.off_policy_steps >= 1" in str(err.value)
    assert "groups_per_step >=" not in str(err.value)


def test_sync_and_colocated_runs_are_not_checked() -> None:
    for c in (cfg(rollout={"mode": "sync", "max_concurrency": 256}),
              cfg(run={"colocated": True}, rollout={"max_concurrency": 256})):  # fmt: skip
        f = check_fit(c)
        assert f.problems() == [] and f.warnings() == []
        assert "not checked" in f.explain()
    assert fit(cfg(run={"colocated": True}, rollout={"num_workers": 3})).workers == 1


def test_the_live_workers_replace_the_configured_count() -> None:
    # The defaults fit one worker of C 16 (4 in flight, B auto 4 from the config's one
    # worker, lag 1). Compose scaled to sixteen: 16 x 16 / 4 = 64 in flight, 64 / 4 = 16
    # versions, above K + 1 = 9; refusable arithmetic, the fixes for sixteen workers
    # (B >= ceil(16 x 16 / (4 x 9)) = 8). Workers of 16 and 48 slots count as two of 32:
    # the same 16 groups in flight.
    c = cfg()
    assert fit_live(c, []) == fit(c)
    many = fit_live(c, [16] * 16)
    assert (many.workers, many.groups_in_flight, many.lag_rollout_bound) == (16, 64, 16)
    [problem] = many.problems()
    assert "16 x 16 / 4 = 64 groups in flight" in problem
    assert "trainer.groups_per_step >= 8" in problem
    mixed = fit_live(c, [16, 48])
    assert (mixed.workers, mixed.slots, mixed.groups_in_flight) == (2, 32, 16)
    assert fit_live(c, [16]).problems() == []
