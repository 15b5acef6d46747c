"""The one typed config of the specd daemon: its own fields plus the nested ``EngineConfig``.

One flat namespace of names covers both, so each field has exactly one CLI flag (``--http-port``),
one environment variable (``SPECD_HTTP_PORT``) and one TOML key (``http_port``), whichever model it
lives in. Precedence, highest first: flags > environment > TOML file (``--config`` / ``$SPECD_CONFIG``)
> defaults. ``kvd_run_dir`` also reads ``$KVD_RUN_DIR``, kvd's own variable, so one environment
serves both daemons (``$SPECD_KVD_RUN_DIR`` wins over it). No other specd module reads ``os.environ``.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field

from specd.engine.config import EngineConfig

ENV_PREFIX = "SPECD_"
# Variables that set a field besides SPECD_<FIELD>, lowest precedence first.
ENV_ALIASES = {"kvd_run_dir": ("KVD_RUN_DIR",)}


class ConfigError(ValueError):
    """An unknown key or a value that does not validate, with the source it came from."""


class SpecdConfig(BaseModel):
    """specd settings. ``engine`` holds what the engine needs; the rest is the daemon's I/O."""

    model_config = ConfigDict(extra="forbid")

    run_dir: Path = Field(Path("/run/specd"), description="Directory of the IPC socket specd.sock (mode 0660).")
    http_host: str = Field("127.0.0.1", description="Address the OpenAI-compatible HTTP gateway listens on.")
    http_port: int = Field(8000, ge=1, le=65535, description="Port of the HTTP gateway.")
    request_timeout_s: float = Field(
        60.0, gt=0, description="Gateway: longest wait for the engine's next reply before answering 503.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Logging threshold.")
    gc_freeze: bool = Field(
        True, description="Once the engine and gateway are up, freeze the start-up heap (model, tokenizer, CUDA "
                          "graphs, imports) out of Python's garbage-collector passes, so a full pass never walks it "
                          "inside a serving step (kvd/gc_pauses.py). Off: the default collector.")
    read_in_forward: bool = Field(
        False, description="While the GPU runs a long prompt step, read the requests that arrive and ask kvd to "
                           "start promoting their cached prefixes at once (prefix warm), instead of after the step; "
                           "they are still added to the engine after it. Off by default: on the 8B agentic load it "
                           "brought no measured gain (run BW) and it keeps a core spinning during those steps "
                           "(docs/design/kvd.md, \"Prefetch on arrival\").")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Model and engine settings.")

    @classmethod
    def load(cls, toml_path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
             flags: Mapping[str, Any] | None = None) -> "SpecdConfig":
        """Merge defaults < file < env < flags, all keyed by flat field names; raise ConfigError."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        if toml_path is not None:
            values.update(_checked(_read_toml(toml_path), f"config file {toml_path}"))
        values.update(_from_env(env))
        values.update({k: v for k, v in _checked(dict(flags or {}), "flags").items() if v is not None})
        return cls.from_flat(values)

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> "SpecdConfig":
        daemon = {k: v for k, v in values.items() if k in daemon_fields()}
        engine = {k: v for k, v in values.items() if k in EngineConfig.model_fields}
        try:
            return cls(engine=EngineConfig(**engine), **daemon)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def config_file(flag: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The TOML file to read: ``--config`` if given, else ``$SPECD_CONFIG``, else none."""
    env = os.environ if env is None else env
    return flag or env.get(ENV_PREFIX + "CONFIG") or None


def daemon_fields() -> dict[str, Any]:
    """SpecdConfig's own fields (all but the nested engine)."""
    return {k: f for k, f in SpecdConfig.model_fields.items() if k != "engine"}


def flat_fields() -> dict[str, Any]:
    """Every settable field by its flat name: the daemon's, then the engine's."""
    fields = {**daemon_fields(), **EngineConfig.model_fields}
    assert len(fields) == len(daemon_fields()) + len(EngineConfig.model_fields), "field names must not collide"
    return fields


def env_names(name: str) -> tuple[str, ...]:
    """Environment variables that set ``name``, lowest precedence first."""
    return (*ENV_ALIASES.get(name, ()), ENV_PREFIX + name.upper())


def _checked(values: dict[str, Any], source: str) -> dict[str, Any]:
    unknown = sorted(set(values) - set(flat_fields()))
    if unknown:
        raise ConfigError(f"{source}: unknown setting(s) {', '.join(unknown)}")
    return values


def _read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """String values; pydantic parses them. An empty variable counts as unset."""
    out: dict[str, Any] = {}
    for name in flat_fields():
        for var in env_names(name):
            if env.get(var):
                out[name] = env[var]
    return out
