"""systemd units pass ``systemd-analyze verify`` (CI installs Debian's ``systemd`` package for it)."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "systemd"


def _analyzer() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze missing in CI: install the Debian package 'systemd'")
        pytest.skip("systemd-analyze not installed (apt-get install -y systemd)")
    return exe


def _stub(path: Path, module: str) -> Path:
    """An executable that runs ``python -m module``: the installed console script may not be on PATH."""
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -m {module} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_units_verify(tmp_path):
    exe = _analyzer()
    for unit, module in (("kvd", "kvd"), ("specd", "specd")):
        binary = _stub(tmp_path / f"{unit}-bin", module)
        text = (UNITS / f"{unit}.service").read_text()
        assert f"ExecStart=/usr/local/bin/{unit} --config /etc/{unit}/{unit}.toml" in text
        (tmp_path / f"{unit}.service").write_text(text.replace(f"/usr/local/bin/{unit}", str(binary)))
    out = subprocess.run([exe, "verify", "kvd.service", "specd.service"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_unit_contract():
    kvd = (UNITS / "kvd.service").read_text()
    specd = (UNITS / "specd.service").read_text()
    for line in ("RuntimeDirectory=kvd", "RuntimeDirectoryMode=0750", "Environment=KVD_RUN_DIR=/run/kvd",
                 "Restart=on-failure", "UMask=0007"):
        assert line in kvd
    for line in ("Requires=kvd.service", "After=kvd.service", "RuntimeDirectory=specd",
                 "Environment=SPECD_RUN_DIR=/run/specd KVD_RUN_DIR=/run/kvd"):
        assert line in specd


def test_example_config_loads():
    from kvd.config import KvdConfig

    cfg = KvdConfig.load(UNITS / "kvd.toml.example", env={})
    assert cfg.run_dir == Path("/run/kvd") and cfg.socket_mode == 0o660
