"""A markdown table straight from a run's ``requests.jsonl`` (one measured request per line).

    python -m bench.requests_table runs/x/requests.jsonl

``bench serve`` writes its full report only when every cell has run; this reads the raw records, so
a run cut short (a failed cell, a time limit) still yields the cells it finished. Wall time per cell is
first send to last token, so throughput here is output tokens over that span.
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from bench.stats import percentile

HEADER = ("| concurrency | config | requests ok | failed | out tok/s | TTFT p50 ms | TTFT p99 ms | "
          "ITL p50 ms | ITL p99 ms | prompt tokens | from cache |\n|---|---|---|---|---|---|---|---|---|---|---|")


def table(records: list[dict]) -> str:
    cells: dict[tuple[int, str], list[dict]] = collections.defaultdict(list)
    for r in records:
        cells[(r["concurrency"], r["config"])].append(r)
    lines = [HEADER]
    for (level, config), rs in sorted(cells.items()):
        ok = [r for r in rs if not r["error"]]
        if not ok:
            lines.append(f"| {level} | {config} | 0 | {len(rs)} | | | | | | | |")
            continue
        wall = max(r["done_s"] for r in ok) - min(r["sent_s"] for r in ok)
        ttft = [1e3 * r["ttft_s"] for r in ok]
        itl = [1e3 * x for r in ok for x in r["itl_s"]]
        prompt = sum(r["prompt_tokens"] for r in ok)
        cached = sum(r["cached_tokens"] for r in ok)
        out = sum(r["completion_tokens"] for r in ok)
        lines.append(f"| {level} | {config} | {len(ok)} | {len(rs) - len(ok)} | {out / wall:.0f} | "
                     f"{percentile(ttft, 50):.0f} | {percentile(ttft, 99):.0f} | {percentile(itl, 50):.1f} | "
                     f"{percentile(itl, 99):.1f} | {prompt} | {100 * cached / prompt:.1f}% |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("requests", type=Path)
    args = ap.parse_args()
    with args.requests.open() as f:
        print(table([json.loads(line) for line in f if line.strip()]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
