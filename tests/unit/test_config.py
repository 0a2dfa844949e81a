from pathlib import Path

import pytest

from streamrl.config import Config, ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = [p for p in (REPO / "examples").glob("*/*.toml") if p.name != "pyproject.toml"]
CONFIGS = sorted((REPO / "configs").glob("*.toml")) + sorted(EXAMPLES)


def test_repo_has_configs() -> None:
    assert any(p.name == "tiny.toml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_parses(path: Path) -> None:
    assert isinstance(load_config(path), Config)


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown key `trainer.lerning_rate`"):
        parse_config({"trainer": {"lerning_rate": 0.1}})


def test_unknown_section_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown key `trainr`"):
        parse_config({"trainr": {}})


def test_bounds_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"field `rollout.temperature`"):
        parse_config({"rollout": {"temperature": -1.0}})


def test_cross_field_check() -> None:
    # Members start as slots free: fewer slots than a group's members is allowed.
    assert parse_config({"rollout": {"max_concurrency": 1, "num_generations": 4}})
    with pytest.raises(
        ConfigError,
        match=r"rollout.max_prompt_length \(128\) \+ rollout.max_response_length \(200\) = 328 "
        r"exceeds rollout.kv_cache_size \(256\)",
    ):
        parse_config({"rollout": {"max_response_length": 200, "kv_cache_size": 256}})
    with pytest.raises(ConfigError, match=r"kv_cache_size \(512\) exceeds model.max_seq_len"):
        parse_config({"rollout": {"kv_cache_size": 512}, "model": {"max_seq_len": 256}})
    with pytest.raises(ConfigError, match=r"trainer.num_processes \(2\) needs a trainer"):
        parse_config({"trainer": {"num_processes": 2, "mesh_data": 2}, "run": {"colocated": True}})
    with pytest.raises(ConfigError, match=r"\(3 devices\) must span all trainer.num_processes"):
        parse_config({"trainer": {"num_processes": 2, "mesh_data": 3}})
    assert (
        parse_config({"trainer": {"num_processes": 2, "mesh_fsdp": 4}}).trainer.num_processes == 2
    )
    with pytest.raises(
        ConfigError, match=r"rollout.max_partial_groups \(2\) needs grouper.group_timeout_s > 0"
    ):
        parse_config({"rollout": {"max_partial_groups": 2}})
    ok = {"rollout": {"max_partial_groups": 2}, "grouper": {"group_timeout_s": 60}}
    assert parse_config(ok).rollout.max_partial_groups == 2
    with pytest.raises(
        ConfigError,
        match=r"grouper.min_valid_members \(5\) exceeds rollout.num_generations \(4\)",
    ):
        parse_config({"grouper": {"min_valid_members": 5}, "rollout": {"num_generations": 4}})
    full = {"grouper": {"min_valid_members": 4}, "rollout": {"num_generations": 4}}
    assert parse_config(full).grouper.min_valid_members == 4


def test_overrides() -> None:
    cfg = parse_config({}, overrides=["trainer.publish_every=3", "run.name=abc"])
    assert cfg.trainer.publish_every == 3
    assert cfg.run.name == "abc"
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        parse_config({}, overrides=["nonsense"])


def test_every_field_is_documented() -> None:
    def walk(model: type) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            if not field.description:
                missing.append(f"{model.__name__}.{name}")
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                missing += walk(ann)
        return missing

    assert walk(Config) == []


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname=")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.toml")


def test_overrides_reach_nested_tables() -> None:
    data = {"task": {"name": "synthetic", "options": {"turns": 2}}}
    cfg = parse_config(data, overrides=["task.options.latency_s=0.5", "run.name=x"])
    assert cfg.task.options == {"turns": 2, "latency_s": 0.5} and cfg.run.name == "x"
    assert data["task"]["options"] == {"turns": 2}  # the caller's tables are not changed
    with pytest.raises(ConfigError, match=r"`task.name` is not a table"):
        parse_config(data, overrides=["task.name.x=1"])


def test_importance_correction_needs_the_trainers_own_ratio() -> None:
    with pytest.raises(ConfigError, match=r"importance_correction = 'tis' needs trainer.use_"):
        parse_config({"trainer": {"importance_correction": "tis"}})
    t = parse_config(
        {"trainer": {"importance_correction": "icepop", "use_rollout_logps": False}}
    ).trainer
    assert t.needs_rollout_logps and t.importance_cap == 2.0
    assert not parse_config({"trainer": {"use_rollout_logps": False}}).trainer.needs_rollout_logps
    with pytest.raises(ConfigError, match=r"trainer.importance_cap"):
        parse_config({"trainer": {"importance_cap": 1.0}})


def test_sync_rollout_needs_one_worker_and_a_version_per_step() -> None:
    assert parse_config({}).rollout.mode == "async"
    with pytest.raises(ConfigError, match=r"field `rollout.mode`: Input should be 'async' or"):
        parse_config({"rollout": {"mode": "lockstep"}})
    with pytest.raises(
        ConfigError, match=r'rollout.mode = "sync" needs rollout.num_workers = 1 \(not 2\)'
    ):
        parse_config({"rollout": {"mode": "sync", "num_workers": 2}})
    with pytest.raises(
        ConfigError, match=r'rollout.mode = "sync" needs trainer.publish_every = 1 \(not 3\)'
    ):
        parse_config({"rollout": {"mode": "sync"}, "trainer": {"publish_every": 3}})
    assert parse_config({"rollout": {"num_workers": 2}, "trainer": {"publish_every": 3}})
    both = parse_config({"rollout": {"mode": "sync"}, "run": {"colocated": True}})
    assert both.rollout.mode == "sync" and both.run.colocated


def test_each_value_set_is_defined_once_in_the_schema() -> None:
    """code review 86b402d item 6: the modules that take a configured value name it with the
    schema's own Literal alias, not a copy that could drift from it."""
    from typing import get_args

    from streamrl import config, weightsync
    from streamrl.rl import losses
    from streamrl.rollout import loader, weights
    from streamrl.tools import backends

    assert weights.SyncMode is config.SyncMode and loader.LoraServing is config.LoraServing
    assert backends.SandboxKind is config.SandboxKind
    assert losses.KlEstimator is config.KlEstimator
    assert losses.Correction is config.Correction
    assert weightsync.Checksum is config.Checksum
    assert weightsync.ChannelName is config.ChannelName
    fields = {
        ("rollout", "sync_mode"): config.SyncMode,
        ("rollout", "lora_serving"): config.LoraServing,
        ("tools", "sandbox"): config.SandboxKind,
        ("trainer", "kl_estimator"): config.KlEstimator,
        ("trainer", "importance_correction"): config.Correction,
        ("trainer", "weights_checksum"): config.Checksum,
        ("trainer", "weights_channel"): config.ChannelName,
    }
    sections = Config.model_fields
    for (section, name), alias in fields.items():
        section_model = sections[section].annotation
        assert section_model is not None
        annotation = section_model.model_fields[name].annotation
        assert get_args(annotation) == get_args(alias), (section, name)


def test_the_run_name_rule_and_the_backoff_cap_are_stated_once() -> None:
    """code review 86b402d: the run-name pattern (config and names.py) and the 60 s restart
    backoff cap (config's description and the launcher) were written twice."""
    from streamrl import config, names
    from streamrl.run import supervise

    assert names.NAME_PATTERN is config.NAME_PATTERN
    assert supervise.MAX_BACKOFF_S is config.MAX_BACKOFF_S
    backoff = config.RunConfig.model_fields["restart_backoff_s"].description or ""
    assert f"max {config.MAX_BACKOFF_S:g} s" in backoff
    assert supervise.backoff_s(100, 1.0) == config.MAX_BACKOFF_S


def test_the_container_cap_must_hold_the_warm_pool_and_a_call() -> None:
    with pytest.raises(ConfigError, match=r"tools.max_containers \(4\) must be at least"):
        parse_config({"tools": {"pool_size": 8, "max_containers": 4}})
    tools = parse_config({"tools": {"pool_size": 3, "max_containers": 4}}).tools
    assert (tools.max_containers, tools.max_starting) == (4, 2)
    with pytest.raises(ConfigError, match=r"tools.max_starting"):
        parse_config({"tools": {"max_starting": 0}})


def test_restarts_outlast_a_poison_entry() -> None:
    """Review N12: an entry that kills its worker at each read is dead-lettered after
    `transport.max_deliveries` crashes; the launcher must allow more restarts than that,
    or the run stops before the dead letter (both were 5)."""
    cfg = parse_config({})
    assert cfg.run.max_restarts > cfg.transport.max_deliveries
    with pytest.raises(
        ConfigError, match=r"run.max_restarts \(5\) must exceed transport.max_deliveries \(5\)"
    ):
        parse_config({"run": {"max_restarts": 5}})
    assert parse_config({"run": {"max_restarts": 6}}).run.max_restarts == 6
    assert parse_config({"run": {"max_restarts": 0}}).run.max_restarts == 0  # never restart


def test_an_agent_program_excludes_another_agent() -> None:
    program = ["python3", "agent.py"]
    cfg = parse_config({"task": {"agent_command": program, "agent_dir": "examples"}})
    assert cfg.task.agent_command == program and cfg.task.agent == ""
    with pytest.raises(ConfigError, match=r"task.agent_command runs the agent program"):
        parse_config({"task": {"agent_command": program, "agent": "openai:m:main"}})
    with pytest.raises(ConfigError, match=r"task.agent_dir is the agent program's"):
        parse_config({"task": {"agent_dir": "examples"}})
