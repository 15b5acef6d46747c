"""bench.provenance: an exported tree names its commit from its COMMIT file, never from an enclosing checkout."""
import subprocess

from bench.provenance import REPO, git_commit


def test_checkout_reports_its_head():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if not head:                      # an exported tree (no git): covered by the next tests
        return
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    mark = "+dirty" if dirty else ""
    # git lengthens the short form as the object count grows (8 in CI's clone, 7 here): ask git, never assume 7
    short = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    assert head.startswith(short) and len(short) >= 7
    assert git_commit() == head + mark and git_commit(short=True) == short + mark


def test_a_checkout_with_changed_tracked_files_says_it_is_dirty(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "untracked.txt").write_text("not part of the result\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "a.py"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x"],
                   check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_commit(repo=tmp_path) == head                  # untracked files do not count
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(repo=tmp_path) == head + "+dirty"
    short = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                           text=True).stdout.strip()
    assert git_commit(short=True, repo=tmp_path) == short + "+dirty"


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
