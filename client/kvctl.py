"""``kvctl``: look into and steer a running kvd.

Read-only commands (stats, top, leases, sessions) use ``kvd.sock``; pin, unpin, evict and flush use
``kvd-admin.sock``, whose permissions decide who may change the cache. ``hash`` computes block
hashes locally with kvd.hashing, so it works without a daemon. Every command prints a readable
table, or exactly one JSON object with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from client.kvd_client import KvdClient, KvdClientError
from kvd.config import KvdConfig
from kvd.hashing import chain_hashes, namespace_root
from kvd.types import HASH_BYTES, Tier

TIERS = {t.name.lower(): int(t) for t in Tier}


# ---- rendering ----
def _jsonable(obj: Any) -> Any:
    """Bytes (hashes) become hex, so --json output is plain JSON."""
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj).hex()
    if isinstance(obj, dict):
        return {str(k.hex() if isinstance(k, bytes) else k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"))
    return "-" if v is None else str(v)


def table(rows: Sequence[dict[str, Any]], columns: Optional[Sequence[str]] = None) -> str:
    """A left-aligned text table of dict rows (columns: the union of keys in first-seen order)."""
    if not rows:
        return "(none)"
    cols = list(columns or dict.fromkeys(k for r in rows for k in r))
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def render_stats(stats: dict[str, Any]) -> str:
    """Nested maps (per tier, per group...) as tables, scalars as one key/value table."""
    scalars = {k: v for k, v in stats.items() if not isinstance(v, (dict, list))}
    parts = [table([{"counter": k, "value": v} for k, v in scalars.items()])]
    for key, val in stats.items():
        if isinstance(val, dict) and val and all(isinstance(v, dict) for v in val.values()):
            parts.append(f"\n{key}:\n" + table([{"name": k, **v} for k, v in val.items()]))
        elif isinstance(val, dict):
            parts.append(f"\n{key}:\n" + table([{"counter": k, "value": v} for k, v in val.items()]))
        elif isinstance(val, list):
            parts.append(f"\n{key}:\n" + table([v if isinstance(v, dict) else {"value": v} for v in val]))
    return "\n".join(parts)


def _rows(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        return [{"key": k, **v} if isinstance(v, dict) else {"key": k, "value": v} for k, v in value.items()]
    return [v if isinstance(v, dict) else {"value": v} for v in value or []]


# ---- commands ----
def cmd_stats(client: KvdClient, args: argparse.Namespace) -> Any:
    stats = client.stats()
    return stats, render_stats(_jsonable(stats))


def cmd_top(client: KvdClient, args: argparse.Namespace) -> Any:
    top = client.top(args.n)
    return {"top": top}, table(_rows(_jsonable(top)))


def cmd_leases(client: KvdClient, args: argparse.Namespace) -> Any:
    leases = client.leases()
    return {"leases": leases}, table(_rows(_jsonable(leases)))


def cmd_sessions(client: KvdClient, args: argparse.Namespace) -> Any:
    sessions = client.sessions()
    return {"sessions": sessions}, table(_rows(_jsonable(sessions)))


def _hashes(args: argparse.Namespace) -> list[bytes]:
    out = []
    for h in args.hashes:
        raw = bytes.fromhex(h)
        if len(raw) != HASH_BYTES:
            raise ValueError(f"{h!r} is not a {HASH_BYTES}-byte hex hash")
        out.append(raw)
    return out


def cmd_admin(client: KvdClient, args: argparse.Namespace) -> Any:
    if args.cmd == "flush":
        result = client.flush(None if args.tier == "all" else TIERS[args.tier])
    else:
        result = getattr(client, args.cmd)(_hashes(args))
    return {"result": result}, f"{args.cmd}: {json.dumps(_jsonable(result))}"


def read_tokens(args: argparse.Namespace) -> list[int]:
    """Token ids from the command line or a file of whitespace/comma separated integers."""
    text = Path(args.tokens_file).read_text() if args.tokens_file else " ".join(args.tokens)
    return [int(t) for t in text.replace(",", " ").split()]


def cmd_hash(args: argparse.Namespace) -> Any:
    tokens = read_tokens(args)
    root = namespace_root(args.model, args.tokenizer, args.dtype, args.layout, args.block_size,
                          args.adapter, args.salt)
    hashes = chain_hashes(root, tokens, args.block_size)
    rows = [{"block": i, "tokens": f"{i * args.block_size}..{(i + 1) * args.block_size - 1}", "hash": h.hex()}
            for i, h in enumerate(hashes)]
    result = {"root": root.hex(), "block_size": args.block_size, "tokens": len(tokens),
              "hashes": [h.hex() for h in hashes]}
    tail = len(tokens) % args.block_size
    note = f"\n({tail} trailing tokens form no full block and are not keyed)" if tail else ""
    return result, f"root {root.hex()}\n" + table(rows) + note


REMOTE = {"stats": cmd_stats, "top": cmd_top, "leases": cmd_leases, "sessions": cmd_sessions,
          "pin": cmd_admin, "unpin": cmd_admin, "evict": cmd_admin, "flush": cmd_admin}
ADMIN = {"pin", "unpin", "evict", "flush"}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print exactly one JSON object")
    parser = argparse.ArgumentParser(prog="kvctl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", help="kvd's run dir (default: KvdConfig's run_dir: $KVD_RUN_DIR or /run/kvd)")
    parser.add_argument("--config", help="kvd TOML config to read run_dir from")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for kvd (default 5)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("stats", parents=[common], help="per-tier capacity/used blocks, lookups, hit rate, leases, evictions")
    sub.add_parser("top", parents=[common], help="hottest prefixes: temperature and tier").add_argument(
        "-n", type=int, default=20, help="how many (default 20)")
    sub.add_parser("leases", parents=[common], help="live leases per client")
    sub.add_parser("sessions", parents=[common], help="sessions kvd keeps tails for")
    for verb in ("pin", "unpin", "evict"):
        p = sub.add_parser(verb, parents=[common], help=f"{verb} blocks by hex hash (admin socket)")
        p.add_argument("hashes", nargs="+", metavar="HASH")
    sub.add_parser("flush", parents=[common], help="drop cached blocks of one tier or all (admin socket)").add_argument(
        "--tier", choices=["all", *TIERS], default="all")
    h = sub.add_parser("hash", parents=[common], help="block hashes of a token list (local, no daemon)")
    h.add_argument("tokens", nargs="*", help="token ids")
    h.add_argument("--tokens-file", help="file of token ids (whitespace or comma separated)")
    h.add_argument("--block-size", type=int, default=16)
    for name in ("model", "tokenizer", "dtype", "layout", "adapter", "salt"):
        h.add_argument(f"--{name}", default="", help=f"namespace field {name} (default empty)")
    return parser


def _run_dir(args: argparse.Namespace) -> Path:
    return Path(args.run_dir) if args.run_dir else KvdConfig.load(args.config).run_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "hash":
            if args.block_size <= 0:
                raise ValueError("--block-size must be positive")
            result, text = cmd_hash(args)
        else:
            with KvdClient(_run_dir(args), admin=args.cmd in ADMIN, timeout_s=args.timeout) as client:
                result, text = REMOTE[args.cmd](client, args)
    except KvdClientError as err:
        print(f"kvctl: {err.message or err.code}" if err.code == "unavailable" else f"kvctl: {err}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as err:
        print(f"kvctl: {err}", file=sys.stderr)
        return 2
    print(json.dumps(_jsonable(result)) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
