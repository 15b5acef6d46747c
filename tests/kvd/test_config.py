import pytest

from kvd.config import KvdConfig, ValidationError


def test_precedence_flags_over_env_over_file(tmp_path):
    toml = tmp_path / "kvd.toml"
    toml.write_text('policy = "lru"\nlease_ttl_s = 20.0\ngpu_blocks = 7\nrun_dir = "/from/file"\n')
    env = {"KVD_LEASE_TTL_S": "40", "KVD_RUN_DIR": "/from/env", "KVD_SOCKET_MODE": "0o600", "HOME": "/x"}
    cfg = KvdConfig.load(toml, env=env, overrides={"lease_ttl_s": 50.0, "policy": None})
    assert cfg.policy == "lru"  # file (flag not given)
    assert cfg.gpu_blocks == 7
    assert str(cfg.run_dir) == "/from/env"  # env over file
    assert cfg.socket_mode == 0o600
    assert cfg.lease_ttl_s == 50.0  # flag over env
    assert KvdConfig.load(None, env={}).run_dir.as_posix() == "/run/kvd"


def test_bad_values_are_refused(tmp_path):
    with pytest.raises(ValidationError):
        KvdConfig.load(None, env={"KVD_POLICY": "fifo"})
    with pytest.raises(ValidationError):
        KvdConfig.load(None, env={}, overrides={"heartbeat_s": 60.0})  # not below the TTL
    with pytest.raises(ValidationError):
        KvdConfig.load(None, env={}, overrides={"gpu_blockz": 1})


def test_capacity_division_rule():
    cfg = KvdConfig(gpu_bytes=1 << 20, max_groups=2)
    assert cfg.blocks_for(cfg.gpu_bytes, None, 1024) == 512
    assert cfg.blocks_for(cfg.gpu_bytes, 3, 1024) == 3
