"""Which code produced a result: the commit every report records.

Why not just ``git rev-parse HEAD``: the GPU runs execute a ``git archive`` export of a commit (a clean tree,
carried in an ignored folder of the checkout), which has no ``.git`` of its own, so git walks up to the
enclosing checkout and reports *its* HEAD — on the device machine a stale one (the first H200 reports of
2026-11-29 say 0f3e250 for code at 6f79688). An export therefore carries a ``COMMIT`` file (written by
bench/gpu/export.sh), and git is trusted only when its top level is this tree. A checkout whose tracked files
differ from HEAD reports ``<commit>+dirty``: its result came from code no commit holds.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit(short: bool = False, repo: Path = REPO) -> str:
    marker = repo / "COMMIT"
    if marker.is_file():
        full = marker.read_text().strip()
        return full[:7] if short else full
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=repo, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if not top or Path(top).resolve() != repo.resolve():
            return "unknown (not a git checkout)"
        args = ["git", "rev-parse", "--short", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
        head = subprocess.run(args, cwd=repo, capture_output=True, text=True, timeout=10).stdout.strip()
        if not head:
            return "unknown"
        # tracked files that differ from HEAD: the result came from code no commit holds, and says so
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{head}+dirty" if changed else head
    except OSError:
        return "unknown"
