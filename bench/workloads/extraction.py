"""Document extraction: SROIE receipt OCR lines -> JSON {company, date, address, total}, scored.

Each turn is one receipt (a batch job sends several per session when --turns > 1); the gold fields ride
along in `turn.reference`, so `score_extraction` makes output quality visible next to speed. Extraction is
run greedy: the answer is a fact, not a sample.
"""
from __future__ import annotations

import json
import random
import re
from datetime import datetime
from pathlib import Path

from bench.workloads.format import Message, Sampling, Session, Turn
from bench.workloads.profile import BuildOptions, Timing, pick, read_keyed_jsonl, session_arrivals, think_times

WORKLOAD = "extraction"
FIELDS = ("company", "date", "address", "total")
TIMING = Timing(rate=2.0, think_median_s=0.5, think_sigma=0.5)  # a pipeline, not a person
DEFAULT_TURNS = 1
DEFAULT_MAX_TOKENS = 160
SYSTEM = ("You extract fields from scanned receipts. Reply with only a JSON object with the keys "
          '"company", "date", "address" and "total", copied from the receipt text. No other text.')
# Two-digit-year spellings first: "%Y" would read "18" as the year 18.
_DATE_FORMATS = ("%d/%m/%y", "%d-%m-%y", "%d.%m.%y", "%d %b %y", "%d/%m/%Y", "%d-%m-%Y", "%d.%m.%Y", "%Y-%m-%d",
                 "%Y/%m/%d", "%d %b %Y", "%d %B %Y", "%d-%b-%Y", "%d/%b/%Y", "%b %d, %Y", "%d%m%Y")


def load_receipts(corpora_dir: Path) -> tuple[list[Path], dict[str, dict]]:
    path = corpora_dir / "extraction/sroie_receipts.jsonl"
    return [path], read_keyed_jsonl(path, "sroie", "id")


def make_session(index: int, items: list[str], receipts: dict[str, dict], arrival_s: float,
                 opts: BuildOptions, rng: random.Random) -> Session:
    pauses = think_times(opts, rng, TIMING, len(items))
    max_tokens = opts.answer_tokens(DEFAULT_MAX_TOKENS)
    turns = [Turn(messages=[Message(role="user", content=opts.clip("\n".join(receipts[item]["ocr_lines"])))],
                  max_tokens=max_tokens, think_time_s=pause, reference=dict(receipts[item]["fields"]))
             for item, pause in zip(items, pauses)]
    return Session(
        id=f"{WORKLOAD}-{opts.split}-{index:05d}", workload=WORKLOAD, split=opts.split, arrival_s=arrival_s,
        system=opts.clip(SYSTEM), turns=turns, sampling=Sampling(temperature=0.0, top_p=1.0, top_k=0),
        meta={"corpus": WORKLOAD, "source_items": items},
    )


def build(opts: BuildOptions) -> list[Session]:
    sources, receipts = load_receipts(opts.corpora_dir)
    split = opts.split_of(WORKLOAD, sources, list(receipts))
    rng = opts.rng(WORKLOAD)
    n_turns = opts.turn_count(DEFAULT_TURNS)
    chosen = pick(rng, split.ids(opts.split), opts.sessions * n_turns)
    starts = session_arrivals(opts, rng, TIMING)
    return [make_session(i, chosen[i * n_turns:(i + 1) * n_turns], receipts, t, opts, rng)
            for i, t in enumerate(starts)]


def parse_json_object(text: str) -> dict | None:
    """The first JSON object in a model's answer (code fences and chatter around it are tolerated)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def normalize_text(value: object) -> str:
    """Case, spacing and punctuation do not count: SROIE OCR is inconsistent about all three."""
    return re.sub(r"[^0-9a-z]", "", str(value).casefold())


def normalize_total(value: object) -> str:
    """'RM 9.00', '9', '1,234.5' -> '9.00', '9.00', '1234.50'; unparsable values fall back to text."""
    digits = re.sub(r"[^0-9.\-]", "", str(value))
    try:
        return f"{float(digits):.2f}"
    except ValueError:
        return normalize_text(value)


def normalize_date(value: object) -> str:
    """Any common receipt date spelling -> ISO 'YYYY-MM-DD'; unknown spellings fall back to text."""
    text = str(value).strip().strip("()")
    for fmt in _DATE_FORMATS:
        try:
            return datetime.strptime(text, fmt).date().isoformat()
        except ValueError:
            continue
    return normalize_text(text)


_NORMALIZERS = {"company": normalize_text, "address": normalize_text, "date": normalize_date,
                "total": normalize_total}


def score_extraction(output_text: str, reference: dict) -> dict:
    """Per-field exact match after normalisation, JSON validity, and the share of fields right.

    Returns {"json_valid": bool, "company": bool, "date": bool, "address": bool, "total": bool,
    "field_accuracy": float in [0, 1]}. Invalid JSON scores every field False.
    """
    parsed = parse_json_object(output_text)
    scores: dict[str, bool | float] = {"json_valid": parsed is not None}
    for name in FIELDS:
        norm = _NORMALIZERS[name]
        scores[name] = (parsed is not None and name in parsed and parsed[name] is not None
                        and norm(parsed[name]) == norm(reference[name]))
    scores["field_accuracy"] = sum(bool(scores[n]) for n in FIELDS) / len(FIELDS)
    return scores
