"""Knowledge assistant: NQ-open questions, each with BM25-retrieved context documents prepended.

The document collection must be available offline, so it is the local Python standard library's
docstrings (read with `ast`, so no module is imported and nothing runs). These documents do not answer
trivia questions; the point is the prompt *shape*: a few kilobytes of retrieved context, then a short
question, with popular documents recurring across sessions. The chunked collection is built once per
Python version and cached under `<cache_dir>/knowledge/`.
"""
from __future__ import annotations

import ast
import json
import platform
import random
import sys
from pathlib import Path

from tqdm import tqdm

from bench.workloads.bm25 import BM25
from bench.workloads.format import Message, Sampling, Session, Turn
from bench.workloads.profile import (BuildOptions, Timing, pick, session_arrivals, stdlib_root, stdlib_sources,
                                     think_times)

WORKLOAD = "knowledge"
TIMING = Timing(rate=0.5, think_median_s=20.0, think_sigma=0.7)  # a person reads the answer, asks again
DEFAULT_TURNS = 2
DEFAULT_MAX_TOKENS = 256
CHUNK_CHARS = 1500  # about 375 tokens: a typical retrieval chunk
SYSTEM = ("You are a knowledge assistant. Answer the question using the context documents provided with it. "
          "Be concise; if the documents do not contain the answer, say so and answer from general knowledge.")


def module_name(path: Path) -> str:
    rel = path.relative_to(stdlib_root()).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def docstrings(path: Path) -> list[str]:
    """'module.qualname' headed docstrings of a module, its classes and functions, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:
        return []
    module = module_name(path)
    out = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append(f"{module}\n{doc}")
    out.extend(_member_docs(tree, module))
    return out


def _member_docs(node: ast.AST, prefix: str) -> list[str]:
    out = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}.{child.name}"
            doc = ast.get_docstring(child)
            if doc:
                out.append(f"{name}\n{doc}")
            if isinstance(child, ast.ClassDef):
                out.extend(_member_docs(child, name))
    return out


def chunk(entries: list[str], chunk_chars: int = CHUNK_CHARS) -> list[str]:
    """Pack consecutive docstrings into chunks of at most chunk_chars (a longer docstring is cut into pieces)."""
    chunks, current = [], ""
    for entry in entries:
        for start in range(0, len(entry), chunk_chars):
            piece = entry[start:start + chunk_chars]
            if current and len(current) + 2 + len(piece) > chunk_chars:
                chunks.append(current)
                current = ""
            current = f"{current}\n\n{piece}" if current else piece
    if current:
        chunks.append(current)
    return chunks


def build_collection(progress: bool = True) -> list[str]:
    """Chunk the docstrings of every stdlib file (the slow step: a few seconds)."""
    chunks: list[str] = []
    for path in tqdm(stdlib_sources(), desc="stdlib docs", unit="file", disable=not progress, file=sys.stderr):
        chunks.extend(chunk(docstrings(path)))
    return chunks


def load_collection(cache_dir: Path, progress: bool = True) -> list[str]:
    """The cached collection for this Python version; built and written on first use."""
    path = cache_dir / "knowledge" / f"stdlib_docs-py{platform.python_version()}-c{CHUNK_CHARS}.json"
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))["chunks"]
    chunks = build_collection(progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"python": platform.python_version(), "chunks": chunks}), encoding="utf-8")
    tmp.replace(path)  # atomic: a killed build never leaves a half-written cache
    return chunks


def load_questions(corpora_dir: Path) -> tuple[list[Path], dict[str, dict]]:
    path = corpora_dir / "knowledge/nq_open_dev.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    return [path], {f"nq/{i:05d}": json.loads(line) for i, line in enumerate(lines)}


def question_message(question: str, documents: list[str]) -> str:
    context = "\n\n".join(f"[{i + 1}] {doc}" for i, doc in enumerate(documents))
    return f"Context documents:\n\n{context}\n\nQuestion: {question}?"


def retrieve(index: BM25, item_id: str, question: str, opts: BuildOptions) -> list[int]:
    """BM25's best chunks; when fewer match (no shared term), filler chunks keyed by the item id.

    A real retriever always returns k documents, so every prompt keeps the same shape.
    """
    k = opts.docs()
    hits = index.top_k(question, k)
    filler = random.Random(f"filler:{item_id}").sample(range(len(index.lengths)), k)
    return hits + [i for i in filler if i not in hits][: k - len(hits)]


def make_session(index: int, items: list[str], questions: dict[str, dict], retrieved: dict[str, list[str]],
                 arrival_s: float, opts: BuildOptions, rng: random.Random) -> Session:
    pauses = think_times(opts, rng, TIMING, len(items))
    max_tokens = opts.answer_tokens(DEFAULT_MAX_TOKENS)
    turns = [Turn(messages=[Message(role="user", content=question_message(
                      questions[item]["question"], [opts.clip(d) for d in retrieved[item]]))],
                  max_tokens=max_tokens, think_time_s=pause, reference={"answer": questions[item]["answer"]})
             for item, pause in zip(items, pauses)]
    return Session(
        id=f"{WORKLOAD}-{opts.split}-{index:05d}", workload=WORKLOAD, split=opts.split, arrival_s=arrival_s,
        system=opts.clip(SYSTEM), turns=turns, sampling=Sampling(temperature=0.7, top_p=0.9, top_k=0),
        meta={"corpus": WORKLOAD, "source_items": items, "python": platform.python_version()},
    )


def build(opts: BuildOptions, progress: bool = True) -> list[Session]:
    sources, questions = load_questions(opts.corpora_dir)
    split = opts.split_of(WORKLOAD, sources, list(questions))
    rng = opts.rng(WORKLOAD)
    n_turns = opts.turn_count(DEFAULT_TURNS)
    chosen = pick(rng, split.ids(opts.split), opts.sessions * n_turns)
    starts = session_arrivals(opts, rng, TIMING)
    collection = load_collection(opts.cache_dir, progress)
    index = BM25(collection)
    retrieved = {item: [collection[i] for i in retrieve(index, item, questions[item]["question"], opts)]
                 for item in set(chosen)}
    return [make_session(i, chosen[i * n_turns:(i + 1) * n_turns], questions, retrieved, t, opts, rng)
            for i, t in enumerate(starts)]
