"""bench.provenance: an exported tree names its commit from its COMMIT file, never from an enclosing checkout."""
import subprocess

from bench.provenance import REPO, git_commit


def test_checkout_reports_its_head():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if not head:                      # an exported tree (no git): covered by the next tests
        return
    assert git_commit() == head and git_commit(short=True) == head[:7]


def test_export_inside_a_checkout_does_not_borrow_its_head(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    export = tmp_path / "export"
    export.mkdir()
    assert git_commit(repo=export).startswith("unknown")
    (export / "COMMIT").write_text("0123456789abcdef0123456789abcdef01234567\n")
    assert git_commit(repo=export) == "0123456789abcdef0123456789abcdef01234567"
    assert git_commit(short=True, repo=export) == "0123456"
