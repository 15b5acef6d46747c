"""The ``specd`` console script.

``specd [flags]`` serves (the default, also ``specd serve``): it loads the engine, runs the IPC server
on its own thread and the HTTP gateway (uvicorn) on the main thread, in one process. ``specd stats``
prints the running daemon's counters. A new subcommand (``train-drafter``) is one more COMMANDS entry.
Every serve flag is generated from a config field (see specd/config.py), so flags and fields map 1:1.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from specd import protocol
from specd.config import ConfigError, SpecdConfig, config_file, env_names, flat_fields

log = logging.getLogger("specd")
EngineFactory = Callable[[Any], Any]


def _add_config_flags(parser: argparse.ArgumentParser, names: list[str] | None = None) -> None:
    """One ``--flag`` per config field; absent flags stay absent so env and file values survive."""
    parser.add_argument("--config", help="TOML file of settings (keys are the field names); $SPECD_CONFIG.")
    for name, field in flat_fields().items():
        if names is not None and name not in names:
            continue
        flag = "--" + name.replace("_", "-")
        env = ", ".join("$" + v for v in env_names(name))
        help_text = f"{field.description} [{env}; default: {field.default}]"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=help_text)


def _load_engine(engine_config: Any) -> Any:
    from specd.engine.engine import SpecEngine  # imported here: torch and the model load are slow

    return SpecEngine.from_config(engine_config)


def serve(cfg: SpecdConfig, engine_factory: EngineFactory = _load_engine) -> int:
    """Engine + IPC server + HTTP gateway in this process, until SIGINT/SIGTERM."""
    import uvicorn

    from client.specd_client import SpecdClient, SpecdTimeoutError
    from specd.gateway import create_app
    from specd.server import SpecdServer

    address = protocol.socket_address(cfg.run_dir)
    with SpecdClient(address=address, timeout_s=0.3) as probe:
        try:
            probe.info()
            log.error("another specd already serves %s; not taking its socket over", address)
            return 1
        except SpecdTimeoutError:
            pass
    engine = engine_factory(cfg.engine)
    server = SpecdServer(engine, address, read_in_forward=cfg.read_in_forward)
    server.start()
    try:
        app = create_app(address, request_timeout_s=cfg.request_timeout_s)
        if cfg.gc_freeze:
            from kvd.gc_pauses import freeze_heap

            freeze_heap("start-up")
        uvicorn.run(app, host=cfg.http_host, port=cfg.http_port, log_level=cfg.log_level)
    finally:
        server.stop()
    return 0


def cmd_serve(argv: list[str], engine_factory: EngineFactory = _load_engine) -> int:
    parser = argparse.ArgumentParser(
        prog="specd", description="Serve a model: engine, IPC socket and OpenAI-compatible HTTP gateway. "
        "Other commands: 'specd stats'.")
    _add_config_flags(parser)
    args = parser.parse_args(argv)
    try:
        cfg = SpecdConfig.load(config_file(args.config), flags=_flags(args))
    except ConfigError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(cfg, engine_factory)


def cmd_stats(argv: list[str]) -> int:
    from client.specd_client import SpecdClient, SpecdError

    parser = argparse.ArgumentParser(prog="specd stats", description="Print the running specd's counters.")
    _add_config_flags(parser, names=["run_dir"])
    parser.add_argument("--json", action="store_true", help="One JSON object, for scripts.")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="How long to wait for the daemon.")
    args = parser.parse_args(argv)
    try:
        cfg = SpecdConfig.load(config_file(args.config), flags=_flags(args))
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        with SpecdClient(cfg.run_dir, timeout_s=args.timeout_s) as client:
            stats = client.stats()
    except SpecdError as exc:
        print(f"specd stats: {exc} (is specd running with run_dir={cfg.run_dir}?)", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2, sort_keys=True) if args.json else _table(stats))
    return 0


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k in flat_fields()}


def _table(stats: dict[str, Any]) -> str:
    width = max((len(k) for k in stats), default=0)
    return "\n".join(f"{k:<{width}}  {v:g}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                     for k, v in sorted(stats.items()))


def cmd_train_drafter(argv: list[str]) -> int:
    from specd.drafter.cli import main as train_drafter  # torch and the trainer load only for this command

    return train_drafter(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {"serve": cmd_serve, "stats": cmd_stats,
                                                   "train-drafter": cmd_train_drafter}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    return cmd_serve(argv)


if __name__ == "__main__":
    sys.exit(main())
