"""The config tree: base.yaml is complete, every rule fires with a message that names the key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pydantic
import pytest
import yaml

from dd_queue.bus._redis_conn import client_kwargs
from dd_queue.cli import main as ddq_main
from dd_queue.config import (
    PRESETS,
    DDQConfig,
    config_path,
    load_config,
    preset_names,
    validate_config,
)
from dd_queue.config.schema import secret_paths
from dd_queue.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"


def _leaf_paths(model: type[pydantic.BaseModel], prefix: str = "") -> dict[str, str | None]:
    """Every leaf field's dotted path, with its description."""
    paths: dict[str, str | None] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
            paths.update(_leaf_paths(ann, f"{prefix}{name}."))
        else:
            paths[f"{prefix}{name}"] = field.description
    return paths


def _yaml_paths(node: object, prefix: str = "") -> set[str]:
    if not isinstance(node, dict) or not node:  # {}: an empty mapping field is a leaf
        return {prefix.rstrip(".")}
    out: set[str] = set()
    for key, value in node.items():
        out |= _yaml_paths(value, f"{prefix}{key}.")
    return out


def test_base_yaml_lists_every_field_and_nothing_else():
    raw = yaml.safe_load((CONFIG_DIR / "base.yaml").read_text())
    assert _yaml_paths(raw) == set(_leaf_paths(DDQConfig))


def test_every_field_is_documented():
    undocumented = [path for path, doc in _leaf_paths(DDQConfig).items() if not doc]
    assert undocumented == []


def test_base_yaml_states_the_model_defaults():
    assert load_config(CONFIG_DIR / "base.yaml") == DDQConfig()


@pytest.mark.parametrize("name", ["base.yaml", "demo.yaml", "test.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(CONFIG_DIR / name)
    assert len(cfg.digest) == 16


def test_the_checkout_config_dir_shows_the_packaged_configs():
    """``config/{base,demo,test}.yaml`` are the packaged files (one copy, shipped in the wheel)."""
    assert preset_names() == ["base", "demo", "test"]
    for name in preset_names():
        assert (CONFIG_DIR / f"{name}.yaml").resolve() == (PRESETS / f"{name}.yaml").resolve()


def test_a_bare_name_is_a_packaged_config_unless_a_file_has_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_path("demo") == PRESETS / "demo.yaml"
    assert load_config("demo") == load_config(CONFIG_DIR / "demo.yaml")
    (tmp_path / "demo").write_text("run: {run_id: mine}\n")
    assert config_path("demo") == Path("demo")
    assert load_config("demo").run.run_id == "mine"
    assert config_path("demo.yaml") == Path("demo.yaml")  # a suffix or a directory: a path
    assert config_path("sub/demo") == Path("sub/demo")
    with pytest.raises(ConfigError, match=r"cannot read config demo\.yaml"):
        load_config("demo.yaml")


def test_an_unknown_bare_name_lists_the_packaged_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"'demoo' is neither a file nor a packaged config "):
        load_config("demoo")
    with pytest.raises(ConfigError, match=r"\(packaged: base, demo, test\)"):
        config_path("demoo")


@pytest.mark.parametrize("parent", ["base.yaml", "base"])
def test_extends_falls_back_to_the_packaged_config(tmp_path, parent):
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"extends: {parent}\nlearner: {{max_steps: 7}}\n")
    cfg = load_config(mine)
    assert cfg.learner.max_steps == 7
    assert cfg.model_copy(update={"learner": DDQConfig().learner}) == DDQConfig()


def test_extends_prefers_the_file_beside_and_names_a_missing_one(tmp_path):
    (tmp_path / "base.yaml").write_text("run: {run_id: beside}\n")
    (tmp_path / "mine.yaml").write_text("extends: base.yaml\n")
    assert load_config(tmp_path / "mine.yaml").run.run_id == "beside"
    (tmp_path / "other.yaml").write_text("extends: nosuch.yaml\n")
    with pytest.raises(ConfigError, match=r"cannot read config .*nosuch\.yaml"):
        load_config(tmp_path / "other.yaml")
    (tmp_path / "deep.yaml").write_text("extends: ../base\n")  # a directory part: no fallback
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "deep.yaml")


def test_derived_file_overrides_only_what_it_names():
    cfg = load_config(CONFIG_DIR / "test.yaml")
    assert cfg.run.run_id == "test"
    assert cfg.redis.max_block_ms == 200
    assert cfg.redis.url == DDQConfig().redis.url  # inherited from base.yaml


def test_config_is_frozen():
    cfg = DDQConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.synchronizer.quorum = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"synchronizer": {"quorm": 2}}, ["synchronizer.quorm", "unknown key"]),
        ({"synchronizr": {}}, ["synchronizr", "unknown key"]),
        ({"synchronizer": {"quorum": 0}}, ["synchronizer.quorum", "greater than or equal to 1"]),
        (
            {"membership": {"heartbeat_interval_s": 5.0, "dead_after_s": 12.0}},
            ["dead_after_s", "3 × heartbeat_interval_s"],
        ),
        (
            {"membership": {"straggling_after_s": 5.0, "stalled_after_s": 4.0}},
            ["must rise"],
        ),
        ({"redis": {"max_block_ms": 9_500}}, ["max_block_ms", "socket_timeout_s"]),
        (
            {"synchronizer": {"grace_cap_s": 90.0, "round_timeout_s": 60.0}},
            ["grace_cap_s", "round_timeout_s"],
        ),
        (
            {"synchronizer": {"quorum": 5, "quorum_policy": "wait"}},
            ["quorum 5", "expected_learners 2", "shrink"],
        ),
        ({"run": {"run_id": "a{b}"}}, ["run.run_id", "letters, digits"]),
        ({"model": {"d_model": 30, "n_heads": 4}}, ["model", "divisible"]),
        ({"wire": {"codec": "int3"}}, ["wire.codec", "'int8'"]),
        ({"faults": {"schedule": [{"at_s": 1, "target": "L0", "kind": "melt"}]}}, ["kind"]),
    ],
    ids=[
        "unknown-field",
        "unknown-section",
        "quorum-below-1",
        "heartbeat-timeout",
        "threshold-order",
        "block-vs-socket",
        "grace-cap",
        "quorum-unreachable",
        "run-id-charset",
        "heads",
        "codec-name",
        "fault-kind",
    ],
)
def test_invalid_config_names_key_and_fix(raw, words):
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    for word in words:
        assert word in str(err.value)


def test_env_overrides_parse_yaml_scalars():
    env = {
        "DDQ__SYNCHRONIZER__QUORUM": "2",
        "DDQ__SYNCHRONIZER__GRACE_CAP_S": "null",
        "DDQ__SYNCHRONIZER__EMBEDDING_PATTERNS": "[wte, head]",
        "DDQ__LEARNER__ERROR_FEEDBACK": "false",
        "OTHER": "ignored",
    }
    cfg = load_config(CONFIG_DIR / "base.yaml", env)
    assert cfg.synchronizer.quorum == 2
    assert cfg.synchronizer.grace_cap_s is None
    assert cfg.synchronizer.embedding_patterns == ("wte", "head")
    assert cfg.learner.error_feedback is False


def test_env_override_keeps_text_fields_text():
    digits = "1234567890123456"
    cfg = load_config(CONFIG_DIR / "base.yaml", {"DDQ__CONTROL__ADMIN_TOKEN": digits})
    assert cfg.control.admin_token is not None
    assert cfg.control.admin_token.get_secret_value() == digits


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("DDQ__SYNCHRONIZER__QUORMU", "unknown key synchronizer.quormu"),
        ("DDQ__NOPE__X", "unknown key nope"),
        ("DDQ__RUN__RUN_ID__X", "is a value, not a section"),
        ("DDQ__RUN", "DDQ__SECTION__FIELD"),
    ],
)
def test_bad_env_override_is_refused(name, words):
    with pytest.raises(ConfigError, match=words):
        load_config(CONFIG_DIR / "base.yaml", {name: "1"})


def test_env_override_value_is_validated():
    with pytest.raises(ConfigError, match=r"synchronizer\.quorum"):
        load_config(CONFIG_DIR / "base.yaml", {"DDQ__SYNCHRONIZER__QUORUM": "many"})


def test_digest_is_stable_and_ignores_secrets():
    a = DDQConfig()
    b = validate_config({"control": {"admin_token": "secret-secret-secret"}})
    c = validate_config({"synchronizer": {"outer_lr": 0.5}})
    assert a.digest == DDQConfig().digest == b.digest
    assert a.digest != c.digest
    assert "secret" not in json.dumps(b.public_dict())


def test_extends_cycle_and_bad_files(tmp_path: Path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "bad.yaml").write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_cli_config_json_is_last_line(capsys):
    assert ddq_main(["config", "--config", str(CONFIG_DIR / "demo.yaml"), "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["config"]["membership"]["expected_learners"] == 3
    cfg = load_config(CONFIG_DIR / "demo.yaml")
    # the README's troubleshooting compares run digests of two machines with this
    assert (last["digest"], last["run_digest"]) == (cfg.digest, cfg.run_digest)
    assert ddq_main(["config", "--config", str(CONFIG_DIR / "demo.yaml")]) == 0
    assert f"# run digest: {cfg.run_digest}" in capsys.readouterr().out


def test_cli_reports_config_errors_with_exit_2(tmp_path: Path, capsys):
    (tmp_path / "x.yaml").write_text("synchronizer: {quorum: 0}\n")
    assert ddq_main(["config", "--config", str(tmp_path / "x.yaml")]) == 2
    assert "synchronizer.quorum" in capsys.readouterr().err


def test_sections_build_the_core_parameters():
    cfg = load_config(CONFIG_DIR / "test.yaml", {"DDQ__SYNCHRONIZER__GRACE_GAMMA": "0.25"})
    policy = cfg.synchronizer.policy_params()
    assert policy.grace_gamma == 0.25
    assert policy.round_timeout_s == cfg.synchronizer.round_timeout_s
    assert cfg.membership.params().dead_after_s == cfg.membership.dead_after_s


def test_wire_section_builds_codec_and_limits():
    cfg = validate_config({"wire": {"codec": "bf16", "zstd_level": 3, "shuffle": True}})
    spec = cfg.wire.codec_spec()
    assert (spec.name, spec.zstd_level, spec.shuffle) == ("bf16", 3, True)
    limits = cfg.wire.message_limits()
    assert limits.max_envelope_bytes == cfg.wire.max_envelope_bytes
    assert limits.tensor.max_elements == cfg.wire.max_elements


def test_shuffle_without_zstd_is_refused():
    with pytest.raises(ConfigError, match="shuffle needs"):
        validate_config({"wire": {"codec": "int8", "shuffle": True, "zstd_level": 1}})


def test_redis_section_builds_bus_options():
    options = load_config(CONFIG_DIR / "test.yaml").redis.options()
    assert options.max_block_ms == 200
    assert options.unavailable_after_s == 5.0


def test_model_section_resolves_preset_with_overrides():
    cfg = validate_config({"model": {"preset": "moe-tiny", "n_layers": 1}})
    spec = cfg.model.spec()
    assert (spec.family, spec.n_layers) == ("moe", 1)
    assert cfg.model.overrides() == {"n_layers": 1}


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"model": {"preset": "gpt-huge"}}, ["unknown model preset", "gpt-tiny"]),
        ({"data": {"source": "npz"}}, ["needs data.path"]),
        ({"data": {"source": "digits"}}, ["image examples", "vit"]),
        ({"model": {"preset": "vit-tiny"}}, ["text examples", "vit model"]),
    ],
)
def test_model_and_data_must_fit(raw, words):
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    for word in words:
        assert word in str(err.value)


def test_data_section_builds_loader_spec():
    cfg = validate_config({"data": {"max_bytes": 4096}})
    spec = cfg.data.spec(vocab_size=cfg.model.spec().vocab_size)
    assert (spec.source, spec.max_bytes, spec.vocab_size) == ("stdlib-text", 4096, 256)


def test_run_digest_ignores_what_may_differ_between_machines():
    base = DDQConfig()
    local = validate_config(
        {
            "redis": {"url": "redis://10.0.0.5:6379/0"},
            "learner": {"device": "cuda:1"},
            "wire": {"codec": "int8"},
            "run": {"log_level": "DEBUG"},
        }
    )
    assert local.run_digest == base.run_digest
    assert local.digest != base.digest
    for change in (
        {"synchronizer": {"n_fragments": 8}},
        {"model": {"n_layers": 3}},
        {"run": {"run_id": "other"}},
    ):
        assert validate_config(change).run_digest != base.run_digest


SECRET = "s3cret-pw-0123456789"


def test_a_password_in_the_url_becomes_a_secret_never_printed(capsys, monkeypatch):
    cfg = validate_config({"redis": {"url": f"redis://alice:{SECRET}@db:6379/0"}})
    assert cfg.redis.url == "redis://alice@db:6379/0"
    assert cfg.redis.password is not None and cfg.redis.password.get_secret_value() == SECRET
    assert cfg.redis.options().password == cfg.redis.password
    assert SECRET not in repr(cfg) + str(cfg) + repr(cfg.redis.options())
    assert SECRET not in json.dumps(cfg.public_dict())
    assert cfg.public_dict()["redis"]["password"] == "***"
    assert validate_config(cfg.model_dump()) == cfg  # validates again unchanged
    monkeypatch.setenv("DDQ__REDIS__URL", f"redis://:{SECRET}@db:6379/0")
    for argv in (["config"], ["config", "--json"]):
        assert ddq_main([*argv, "--config", str(CONFIG_DIR / "demo.yaml")]) == 0
        out = capsys.readouterr()
        assert SECRET not in out.out + out.err
        assert "redis://db:6379/0" in out.out and "***" in out.out


def test_percent_escapes_of_a_url_password_are_decoded():
    cfg = validate_config({"redis": {"url": "rediss://bob:p%40ss%3Aw@db/2"}})
    assert cfg.redis.url == "rediss://bob@db/2"
    assert cfg.redis.password is not None and cfg.redis.password.get_secret_value() == "p@ss:w"


def test_secrets_read_from_files_as_docker_mounts_them(tmp_path):
    (tmp_path / "pw").write_text(SECRET + "\n")
    (tmp_path / "token").write_text("t" * 20 + "\n")
    cfg = validate_config(
        {
            "redis": {"password_file": str(tmp_path / "pw")},
            "control": {"admin_token_file": str(tmp_path / "token")},
        }
    )
    assert cfg.redis.password is not None and cfg.redis.password.get_secret_value() == SECRET
    assert cfg.control.admin_token is not None
    assert cfg.control.admin_token.get_secret_value() == "t" * 20
    public = cfg.public_dict()
    assert public["redis"]["password_file"] == str(tmp_path / "pw")  # a path is no secret
    assert public["control"]["admin_token"] == "***" and SECRET not in json.dumps(public)
    assert validate_config(cfg.model_dump()) == cfg


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"redis": {"url": "redis://:a@h", "password": "b"}}, "given twice (in url"),
        ({"redis": {"url": "redis://:a@h", "password_file": "/nonexistent"}}, "given twice"),
        ({"redis": {"password": "a", "password_file": "PW"}}, "password is given twice"),
        ({"redis": {"password_file": "/nonexistent/pw"}}, "password_file '/nonexistent/pw'"),
        ({"control": {"admin_token_file": "SHORT"}}, "admin_token: Value should have at least 16"),
    ],
)
def test_bad_secrets_are_refused_without_showing_them(tmp_path, raw, words):
    (tmp_path / "PW").write_text("from-the-file\n")
    (tmp_path / "SHORT").write_text("short\n")
    for section in raw.values():
        for key in ("password_file", "admin_token_file"):
            if section.get(key) in ("PW", "SHORT"):
                section[key] = str(tmp_path / section[key])
    with pytest.raises(ConfigError, match=re.escape(words)) as caught:
        validate_config(raw)
    assert "from-the-file" not in str(caught.value) and "short" not in str(caught.value)


def test_secrets_stay_out_of_the_digests():
    plain = DDQConfig()
    secret = validate_config({"redis": {"password": SECRET}, "control": {"admin_token": "x" * 16}})
    assert (secret.digest, secret.run_digest) == (plain.digest, plain.run_digest)
    assert secret_paths(DDQConfig) == ["redis.password", "control.admin_token"]


def test_tls_files_reach_every_redis_client(tmp_path):
    for name in ("ca.pem", "me.pem", "me.key"):
        (tmp_path / name).write_text("PEM\n")
    cfg = validate_config(
        {
            "redis": {
                "url": "rediss://h:6380/0",
                "tls_ca_file": str(tmp_path / "ca.pem"),
                "tls_cert_file": str(tmp_path / "me.pem"),
                "tls_key_file": str(tmp_path / "me.key"),
                "tls_check_hostname": False,
            }
        }
    )
    kwargs = client_kwargs(cfg.redis.url, cfg.redis.options())
    assert kwargs == {
        "password": None,
        "ssl_cert_reqs": "required",  # the server's certificate is always verified
        "ssl_ca_certs": str(tmp_path / "ca.pem"),
        "ssl_certfile": str(tmp_path / "me.pem"),
        "ssl_keyfile": str(tmp_path / "me.key"),
        "ssl_check_hostname": False,
    }
    plain = client_kwargs("redis://h/0", DDQConfig().redis.options())
    assert plain == {"password": None}  # no ssl_* argument: a plain connection refuses them
    assert validate_config(cfg.model_dump()) == cfg


@pytest.mark.parametrize(
    ("redis", "words"),
    [
        ({"tls_ca_file": "CA"}, "tls_* files are set but the URL redis://127.0.0.1:6379/0 is not"),
        ({"url": "rediss://h/0", "tls_cert_file": "CA"}, "tls_cert_file and tls_key_file go"),
        ({"url": "rediss://h/0", "tls_key_file": "CA"}, "tls_cert_file and tls_key_file go"),
        ({"url": "rediss://h/0", "tls_ca_file": "/nonexistent/ca.pem"}, "'/nonexistent/ca.pem' is"),
    ],
)
def test_bad_tls_settings_are_refused_with_the_reason(tmp_path, redis, words):
    (tmp_path / "CA").write_text("PEM\n")
    redis = {k: str(tmp_path / v) if v == "CA" else v for k, v in redis.items()}
    with pytest.raises(ConfigError, match=re.escape(words)):
        validate_config({"redis": redis})
