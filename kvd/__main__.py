"""``kvd``: the per-node KV cache-tier daemon.

Every KvdConfig field is a flag (``--lease-ttl-s 30``), generated from the model so the two never
drift; precedence is flags > KVD_* environment > ``--config`` TOML > defaults.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from typing import Any, Optional, Sequence

from kvd.config import KvdConfig

DESCRIPTION = """\
kvd keeps KV-cache blocks across a GPU pool, host DRAM (shared memory) and NVMe slab files, and
leases them to specd workers over ZeroMQ: ipc://RUN_DIR/kvd.sock for clients and
ipc://RUN_DIR/kvd-admin.sock for admin verbs (pin, evict, flush). It logs "kvd ready" and writes
RUN_DIR/kvd.pid once both sockets are bound; SIGTERM flushes the NVMe index and exits.

Each option below sets the KvdConfig field of the same name (dashes for underscores). The same field
can come from the environment as KVD_<FIELD> or from the TOML file given with --config; flags win
over the environment, which wins over the file."""


def _flag_type(annotation: Any) -> tuple[Optional[list[str]], str]:
    """(choices, metavar) for a field; values stay strings and pydantic parses them."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in args], "{" + ",".join(map(str, args)) + "}"
    inner = args[0] if args else annotation
    return None, getattr(inner, "__name__", "VALUE").upper()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="TOML file with KvdConfig fields (e.g. /etc/kvd/kvd.toml)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (default INFO)")
    fields = parser.add_argument_group("config fields (KvdConfig)")
    for name, info in KvdConfig.model_fields.items():
        choices, metavar = _flag_type(info.annotation)
        default = info.default if not isinstance(info.default, os.PathLike) else os.fspath(info.default)
        default = oct(default) if name == "socket_mode" else default
        fields.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, choices=choices,
                            metavar=metavar or None,
                            help=f"{info.description} (default {default!r}; env KVD_{name.upper()})")
    return parser


def load_config(args: argparse.Namespace) -> KvdConfig:
    overrides = {name: getattr(args, name) for name in KvdConfig.model_fields}
    if overrides.get("socket_mode") is not None:
        overrides["socket_mode"] = int(overrides["socket_mode"], 0)
    return KvdConfig.load(args.config, os.environ, overrides)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args)
    except (ValueError, OSError) as err:
        print(f"kvd: bad configuration: {err}", file=sys.stderr)
        return 2
    from kvd.core import KvdCore  # after parsing, so --help stays fast
    from kvd.server import KvdServer

    sys.setswitchinterval(config.gil_switch_ms / 1000.0)   # the copy path's GIL waits (KvdConfig.gil_switch_ms)

    server = KvdServer(KvdCore(config), config.run_dir, config.socket_mode)
    server.install_signal_handlers()
    try:
        server.bind()
        if config.gc_freeze:
            from kvd.gc_pauses import freeze_heap

            freeze_heap("start-up")
        server.serve_forever()
    except RuntimeError as err:  # another kvd owns the run dir
        logging.getLogger("kvd").error("%s", err)
        return 1
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
