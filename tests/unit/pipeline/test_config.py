"""Configuration: YAML < environment < CLI flags; wrong values name their field."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, RunConfig, load_config, parse_overrides
from workers.kafka.clients import connection_kwargs
from workers.kafka.config import KafkaConfig, TopicsConfig


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("ROLLOUT_"):
            monkeypatch.delenv(key)


def test_defaults() -> None:
    cfg = load_config()
    assert cfg.kafka.bootstrap_servers == ["localhost:9092"]
    assert cfg.topics.name("turns") == "rl.turns"
    assert cfg.topics.spec("policy").cleanup_policy == "compact"
    assert cfg.topics.spec("replicas").cleanup_policy == "compact"


def test_precedence_yaml_env_cli(tmp_path, monkeypatch) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "kafka:\n  bootstrap_servers: yaml:9092\n  client_id: fromyaml\n"
        "topics:\n  prefix: exp.\n  prompts:\n    partitions: 8\n"
    )
    cfg = load_config(path)
    assert cfg.kafka.bootstrap_servers == ["yaml:9092"]
    assert cfg.topics.name("prompts") == "exp.prompts"
    assert cfg.topics.prompts.partitions == 8

    monkeypatch.setenv("ROLLOUT_KAFKA__BOOTSTRAP_SERVERS", "env1:9092,env2:9092")
    cfg = load_config(path)
    assert cfg.kafka.bootstrap_servers == ["env1:9092", "env2:9092"]
    assert cfg.kafka.client_id == "fromyaml"  # untouched fields still come from YAML

    cfg = load_config(
        path, parse_overrides(["kafka.bootstrap_servers=cli:1", "topics.prompts.partitions=2"])
    )
    assert cfg.kafka.bootstrap_servers == ["cli:1"]
    assert cfg.topics.prompts.partitions == 2
    assert cfg.topics.prefix == "exp."


def test_config_file_from_environment(tmp_path, monkeypatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("topics:\n  prefix: viaenv.\n")
    monkeypatch.setenv("ROLLOUT_CONFIG", str(path))
    assert load_config().topics.prefix == "viaenv."


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["topics.prompts.partitions=0"], "topics.prompts.partitions"),
        (["kafka.bootstrap_servers=nohostport"], "kafka.bootstrap_servers"),
        (["kafka.security_protocol=SASL_SSL"], "kafka"),
        (["kafka.unknown=1"], "kafka.unknown"),
        (["nonsense=1"], "nonsense"),
    ],
)
def test_wrong_values_name_the_field(overrides, field) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, parse_overrides(overrides))
    assert field in str(info.value)


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_config(bad)
    assert "\n" not in str(info.value) and "(line 2, column 1)" in str(info.value)


def test_parse_overrides() -> None:
    assert parse_overrides(["a.b=3", "a.c=[x, y]", "d=text"]) == {
        "a": {"b": 3, "c": ["x", "y"]},
        "d": "text",
    }
    with pytest.raises(ConfigError):
        parse_overrides(["novalue"])
    with pytest.raises(ConfigError, match="not a YAML value"):
        parse_overrides(["kafka.bootstrap_servers=[unclosed"])


def test_security_settings_pass_through_and_secrets_stay_secret() -> None:
    cfg = KafkaConfig(
        bootstrap_servers="b1:9093",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="trainer",
        sasl_password="s3cret",
        ssl_cafile="/etc/ca.pem",
    )
    kwargs = connection_kwargs(cfg)
    assert kwargs["sasl_plain_password"] == "s3cret"
    assert kwargs["ssl_cafile"] == "/etc/ca.pem"
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert "s3cret" not in repr(cfg)
    assert "s3cret" not in cfg.model_dump_json()
    plain = connection_kwargs(KafkaConfig())
    assert "sasl_plain_password" not in plain and "ssl_cafile" not in plain


def test_topic_names_and_specs() -> None:
    topics = TopicsConfig(prefix="x.")
    assert set(topics.all_names().values()) == {
        f"x.{r}"
        for r in ("prompts", "turns", "scored", "replay", "stale", "policy", "replicas", "dlq")
    }
    with pytest.raises(KeyError):
        topics.name("nope")
    with pytest.raises(ValueError, match="min_insync"):
        TopicsConfig(replication_factor=1, min_insync_replicas=2)


def test_replication_follows_the_cluster_unless_configured() -> None:
    # Unset: 1/1 on the one-broker default, production's 3/2 on three brokers or more.
    assert TopicsConfig().replication_for(1) == (1, 1)
    assert TopicsConfig().replication_for(3) == (3, 2)
    assert TopicsConfig().replication_for(5) == (3, 2)
    assert TopicsConfig(replication_factor=2).replication_for(3) == (2, 1)
    assert TopicsConfig(replication_factor=3).replication_for(1) == (3, 2)  # the broker refuses
    assert TopicsConfig(min_insync_replicas=3).replication_for(3) == (3, 3)
    assert TopicsConfig(min_insync_replicas=2).replication_for(1) == (1, 1)


def test_the_stages_shared_values_come_from_the_trainer() -> None:
    cfg = load_config(
        None, parse_overrides(["trainer.max_staleness=32", "trainer.train_batch_size=3"])
    )
    gate = cfg.agent_loop.admission
    assert (gate.max_staleness, gate.train_batch_size) == (32, 3)
    assert cfg.replay.max_staleness == cfg.trainer.max_staleness == 32
    unbounded = load_config()
    assert unbounded.agent_loop.admission.max_staleness is None
    assert unbounded.replay.max_staleness is None
    assert unbounded.agent_loop.admission.train_batch_size == unbounded.trainer.train_batch_size


@pytest.mark.parametrize(("bound", "margin", "gate"), [(32, 8, 24), (2, 0, 2), (3, 8, 0)])
def test_the_gate_runs_its_margin_inside_the_trainers_bound(
    bound: int, margin: int, gate: int
) -> None:
    cfg = RunConfig.model_validate(
        {"trainer": {"max_staleness": bound}, "agent_loop": {"admission": {"margin": margin}}}
    )
    assert cfg.agent_loop.admission.max_staleness == gate
    assert cfg.replay.max_staleness == bound


@pytest.mark.parametrize(
    ("override", "source"),
    [
        ("agent_loop.admission.train_batch_size=8", "trainer.train_batch_size"),
        ("agent_loop.admission.max_staleness=2", "trainer.max_staleness"),
        ("replay.max_staleness=2", "trainer.max_staleness"),
    ],
)
def test_a_derived_copy_is_no_setting(override: str, source: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, parse_overrides([override]))
    message = str(info.value)
    assert f"{override.partition('=')[0]} is derived from {source}" in message
    assert len(message.splitlines()) == 2  # the heading and one line


def test_a_derived_copy_is_refused_from_the_environment_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROLLOUT_REPLAY__MAX_STALENESS", "2")
    with pytest.raises(ConfigError, match=r"replay\.max_staleness is derived"):
        load_config()


def test_the_written_config_loads_again_and_derives_the_same(tmp_path) -> None:
    import yaml

    cfg = load_config(
        None,
        parse_overrides(
            [
                "trainer.max_staleness=4",
                "trainer.train_batch_size=2",
                "agent_loop.admission.margin=1",
            ]
        ),
    )
    dumped = cfg.redacted()
    assert "max_staleness" not in dumped["replay"]
    assert set(dumped["agent_loop"]["admission"]) == {"margin"}
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(dumped))
    again = load_config(path)
    assert again.agent_loop.admission == cfg.agent_loop.admission
    assert again.replay.max_staleness == 4


def test_the_derived_copies_are_the_fields_left_out_of_dumps() -> None:
    """`DERIVED` (refused as settings) and `exclude=True` (no row in the docs, not dumped)
    name the same fields."""
    from pydantic import BaseModel

    from pipeline.config import DERIVED

    def excluded(model: type[BaseModel], prefix: str = "") -> set[str]:
        out = set()
        for name, field in model.model_fields.items():
            if field.exclude:
                out.add(prefix + name)
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                out |= excluded(field.annotation, f"{prefix}{name}.")
        return out

    assert excluded(RunConfig) == set(DERIVED)


def test_a_runs_groups_changelogs_and_checkpoints_follow_its_prefix(monkeypatch) -> None:
    """Two prefixes are two runs: no consumer group, changelog or checkpoint directory in
    common (the same dataset under a new prefix lost every trajectory when the reward
    stage's changelog was named after a fixed group)."""
    runs = [load_config(None, {"topics": {"prefix": p}}) for p in ("cc1.", "cc4.")]
    for cfg, name in zip(runs, ("cc1", "cc4"), strict=True):
        assert cfg.topics.run_name == name
        assert cfg.agent_loop.group_id == f"{name}.agent-loop"
        assert cfg.reward.group_id == f"{name}.reward"
        assert cfg.reward.changelog_topic == f"{name}.reward-trajectories-changelog"
        assert cfg.replay.changelog_topic == f"{name}.replay-groups-changelog"
        assert cfg.trainer.group_id == f"{name}.trainer"
        assert cfg.trainer.checkpoint_dir == f"runs/{name}/checkpoints"
    # Named ones are kept (from a flag or the environment alike), and survive a dump.
    monkeypatch.setenv("ROLLOUT_REPLAY__GROUP_ID", "shared-replay")
    cfg = load_config(
        None,
        {"topics": {"prefix": "x."}, "reward": {"group_id": "mine"},
         "trainer": {"checkpoint_dir": "/ckpt"}},
    )  # fmt: skip
    assert (cfg.reward.group_id, cfg.replay.group_id) == ("mine", "shared-replay")
    assert (cfg.agent_loop.group_id, cfg.trainer.checkpoint_dir) == ("x.agent-loop", "/ckpt")
    again = RunConfig(**cfg.redacted())
    assert again.reward.group_id == "mine" and again.trainer.group_id == "x.trainer"
    assert TopicsConfig(prefix="").run_name == "run"
