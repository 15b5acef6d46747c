"""The train/eval split of each corpus: made once, recorded in a manifest, never silently changed.

A drafter trained on replayed traffic must never see the eval sessions, or its acceptance numbers are
inflated. So the split is a property of the *source items* (a receipt, an MBPP task, a dialogue), not of
the sessions built from them:

- assignment is a pure function of (SPLIT_SEED, corpus, item id) through blake2b, so it does not depend on
  the build seed, on the order items are read, or on how many sessions are built;
- the first build records it in a manifest JSON (item ids per split, sha256 of every source file);
- later builds load the manifest and use it as is. If a source file's sha256 differs, the build stops:
  a changed corpus needs a deliberate new split, not a quiet reshuffle that could move eval items into train.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SPLIT_SEED = 20240601  # fixed forever: changing it moves items between splits.
EVAL_FRACTION = 0.2


class SplitError(RuntimeError):
    """The recorded split no longer matches the corpus (a source file changed)."""


@dataclass(frozen=True)
class CorpusSplit:
    """Item ids of one corpus per split, with the source files' sha256 that the split was made from."""

    corpus: str
    sources: dict[str, str]  # file name -> sha256 hex
    train: tuple[str, ...]
    eval: tuple[str, ...]

    def ids(self, split: str) -> tuple[str, ...]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        return self.train if split == "train" else self.eval

    def to_json(self) -> dict:
        return {
            "corpus": self.corpus,
            "split_seed": SPLIT_SEED,
            "eval_fraction": EVAL_FRACTION,
            "sources": self.sources,
            "train": list(self.train),
            "eval": list(self.eval),
        }


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_eval(corpus: str, item_id: str) -> bool:
    """Whether an item belongs to eval: a uniform draw from a keyed hash, stable across machines and runs."""
    digest = hashlib.blake2b(f"{SPLIT_SEED}:{corpus}:{item_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < EVAL_FRACTION


def make_split(corpus: str, sources: dict[str, str], item_ids: Sequence[str]) -> CorpusSplit:
    """Assign every item; both splits keep the items' original order."""
    if len(set(item_ids)) != len(item_ids):
        raise ValueError(f"{corpus}: item ids are not unique")
    train = tuple(i for i in item_ids if not is_eval(corpus, i))
    evals = tuple(i for i in item_ids if is_eval(corpus, i))
    return CorpusSplit(corpus, dict(sorted(sources.items())), train, evals)


def load_or_create_split(manifest_dir: str | Path, corpus: str, source_paths: Sequence[Path],
                         item_ids: Sequence[str]) -> CorpusSplit:
    """Return the recorded split of `corpus`, creating `<manifest_dir>/<corpus>.json` on first use."""
    sources = {p.name: file_sha256(p) for p in source_paths}
    path = Path(manifest_dir) / f"{corpus}.json"
    if path.exists():
        return _check_recorded(path, corpus, sources)
    split = make_split(corpus, sources, item_ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(split.to_json(), indent=1) + "\n", encoding="utf-8")
    return split


def _check_recorded(path: Path, corpus: str, sources: dict[str, str]) -> CorpusSplit:
    data = json.loads(path.read_text(encoding="utf-8"))
    if data["sources"] != dict(sorted(sources.items())):
        raise SplitError(f"{path}: the corpus files changed since this split was recorded "
                         f"(recorded {data['sources']}, now {sources}); delete the manifest deliberately to re-split")
    if data.get("split_seed") != SPLIT_SEED:
        raise SplitError(f"{path}: recorded with split seed {data.get('split_seed')}, code uses {SPLIT_SEED}")
    return CorpusSplit(corpus, data["sources"], tuple(data["train"]), tuple(data["eval"]))
