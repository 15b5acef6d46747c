"""SpecdConfig precedence (flags > env > file > defaults), flag generation, and `specd stats`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specd.__main__ import main
from specd.config import ConfigError, SpecdConfig, flat_fields


def test_defaults():
    cfg = SpecdConfig.load(env={})
    assert cfg.run_dir == Path("/run/specd") and cfg.http_port == 8000
    assert cfg.engine.kvd_run_dir is None and cfg.engine.block_size == 16


def test_precedence_flags_over_env_over_file(tmp_path):
    toml = tmp_path / "specd.toml"
    toml.write_text('http_port = 7001\nblock_size = 32\nmax_num_seqs = 4\nlog_level = "warning"\n')
    env = {"SPECD_HTTP_PORT": "7002", "SPECD_BLOCK_SIZE": "64"}
    cfg = SpecdConfig.load(toml, env=env, flags={"http_port": "7003"})
    assert cfg.http_port == 7003              # flag beats env and file
    assert cfg.engine.block_size == 64        # env beats file
    assert cfg.engine.max_num_seqs == 4       # file beats default
    assert cfg.log_level == "warning"


def test_kvd_run_dir_reads_kvds_own_variable_and_specd_prefix_wins():
    assert SpecdConfig.load(env={"KVD_RUN_DIR": "/tmp/k1"}).engine.kvd_run_dir == Path("/tmp/k1")
    both = {"KVD_RUN_DIR": "/tmp/k1", "SPECD_KVD_RUN_DIR": "/tmp/k2"}
    assert SpecdConfig.load(env=both).engine.kvd_run_dir == Path("/tmp/k2")


def test_unknown_keys_and_bad_values_are_errors(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("htp_port = 1\n")
    with pytest.raises(ConfigError, match="htp_port"):
        SpecdConfig.load(toml, env={})
    with pytest.raises(ConfigError, match="http_port"):
        SpecdConfig.load(env={"SPECD_HTTP_PORT": "not-a-port"})
    with pytest.raises(ConfigError, match="block_size"):
        SpecdConfig.load(env={}, flags={"block_size": "0"})


def test_every_field_has_a_flag(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    for name in flat_fields():
        assert "--" + name.replace("_", "-") in help_text
    assert "--no-cuda-graphs" in help_text


def test_stats_command_prints_the_running_daemons_counters(server, run_dir, capsys):
    assert main(["stats", "--run-dir", run_dir, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["requests_running"] == 0 and stats["kvd_connected"] == 0
    assert main(["stats", "--run-dir", run_dir]) == 0
    assert "tokens_generated_total" in capsys.readouterr().out


def test_stats_command_fails_cleanly_without_a_daemon(run_dir, capsys):
    assert main(["stats", "--run-dir", run_dir, "--timeout-s", "0.2"]) == 1
    assert "is specd running" in capsys.readouterr().err
