"""kvctl commands that need no daemon: hash (local) and the error when kvd is not running."""
from __future__ import annotations

import json
import subprocess
import sys

from client import kvctl
from kvd.hashing import chain_hashes, namespace_root


def test_hash_matches_kvd_hashing(capsys, tmp_path):
    tokens = list(range(1, 40))
    assert kvctl.main(["hash", "--json", "--block-size", "16", "--salt", "tenant-a", *map(str, tokens)]) == 0
    out = json.loads(capsys.readouterr().out)
    root = namespace_root("", "", "", "", 16, "", "tenant-a")
    assert out["hashes"] == [h.hex() for h in chain_hashes(root, tokens, 16)]
    assert len(out["hashes"]) == 2  # 39 tokens: two full blocks, the tail is not keyed
    f = tmp_path / "toks.txt"
    f.write_text(",".join(map(str, tokens)))
    assert kvctl.main(["hash", "--json", "--block-size", "16", "--tokens-file", str(f)]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["hashes"] != out["hashes"]  # another salt, another namespace


def test_hash_human_table(capsys):
    assert kvctl.main(["hash", "--block-size", "2", "5", "6", "7"]) == 0
    text = capsys.readouterr().out
    assert "block" in text and "hash" in text and "1 trailing tokens" in text


def test_clear_error_when_kvd_is_not_running(tmp_path):
    out = subprocess.run([sys.executable, "-m", "client.kvctl", "--run-dir", str(tmp_path), "stats", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"kvd is not reachable at ipc://{tmp_path}/kvd.sock" in out.stderr
    assert out.stdout == ""
