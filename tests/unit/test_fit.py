"""streamrl.fit: the values a config implies and the combinations refused, worked by hand."""

import pytest

from streamrl.config import Config, ConfigError, parse_config
from streamrl.fit import check_fit, fit, fit_live


def cfg(**sections: dict[str, object]) -> Config:
    return parse_config(dict(sections))


def test_the_issue_29_combination_is_refused_with_its_arithmetic_and_fixes() -> None:
    # C 64, G 4, B 4, K 2: 64 / 4 = 16 groups in flight; 16 / 4 = 4 steps while one runs,
    # above K + 1 = 3. Fixes: B >= ceil(64 / (4 x 3)) = 6 (16 / 6 = 2.67), C <= 3 x 4 x 4 = 48
    # (12 / 4 = 3), K >= 4 - 1 = 3 (limit 4).
    c = cfg(rollout={"max_concurrency": 64}, task={"max_backlog": "auto"})
    f = fit(c)
    assert (f.groups_in_flight, f.lag_rollout_bound, f.limit) == (16, 4, 3)
    with pytest.raises(ConfigError) as err:
        check_fit(c)
    msg = str(err.value)
    assert "1 x 64 / 4 = 16 groups in flight" in msg and "16 / 4 = 4" in msg
    for fix in ("trainer.groups_per_step >= 6", "rollout.max_concurrency <= 48",
                "grouper.off_policy_steps >= 3"):  # fmt: skip
        assert fix in msg, msg
    check_fit(cfg(rollout={"max_concurrency": 64}, trainer={"groups_per_step": 6}))
    check_fit(cfg(rollout={"max_concurrency": 64}, grouper={"off_policy_steps": 3}))
    check_fit(cfg(rollout={"max_concurrency": 48}))
    with pytest.raises(ConfigError):
        check_fit(cfg(rollout={"max_concurrency": 52}))  # 13 / 4 = 3.25


def test_the_defaults_fit_and_say_what_a_full_ready_queue_costs() -> None:
    # C 16, G 4, B 4, K 2, R 64: 4 in flight, lag 1 with rollout the limit; with the trainer
    # the limit (4 + 64) / 4 = 17 versions: a warning, and R <= 4 x 3 - 4 = 8 keeps them
    # ((4 + 8) / 4 = 3). Backlog auto: 16 + 2 x ceil(16 / 4) = 24.
    f = check_fit(cfg())
    assert (f.groups_in_flight, f.lag_rollout_bound, f.lag_trainer_bound) == (4, 1, 17)
    assert (f.backlog, f.backlog_auto) == (24, True)
    assert f.problems() == []
    [warning] = f.warnings()
    assert "17 versions" in warning and "rollout.max_ready_groups <= 8 keeps them" in warning
    assert fit(cfg(rollout={"max_ready_groups": 8})).warnings() == []
    text = f.explain()
    assert "1 x 16 = 16 episodes" in text and "24 (auto)" in text and "warning:" in text


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
    # The defaults fit one worker of C 16 (4 in flight, lag 1). Compose scaled to four: 4 x 16
    # / 4 = 16 in flight, 16 / 4 = 4 versions, above K + 1 = 3; refusable arithmetic, the
    # fixes for four workers (B >= ceil(4 x 16 / (4 x 3)) = 6). Workers of 16 and 48 slots
    # count as two of 32: the same 16 groups in flight.
    c = cfg()
    assert fit_live(c, []) == fit(c)
    four = fit_live(c, [16, 16, 16, 16])
    assert (four.workers, four.groups_in_flight, four.lag_rollout_bound) == (4, 16, 4)
    [problem] = four.problems()
    assert "4 x 16 / 4 = 16 groups in flight" in problem
    assert "trainer.groups_per_step >= 6" in problem
    mixed = fit_live(c, [16, 48])
    assert (mixed.workers, mixed.slots, mixed.groups_in_flight) == (2, 32, 16)
    assert fit_live(c, [16]).problems() == []
