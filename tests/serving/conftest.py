"""Fixtures for the serving tests: a SpecdServer around the fake engine, on a short ipc path."""
from __future__ import annotations

import shutil
import tempfile

import pytest
from fake_engine import FakeEngine

from specd.protocol import socket_address
from specd.server import SpecdServer


@pytest.fixture
def run_dir():
    # ipc paths are limited to ~107 bytes; pytest's tmp_path can be longer than that.
    path = tempfile.mkdtemp(prefix="specd-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def server(engine, run_dir):
    srv = SpecdServer(engine, socket_address(run_dir))
    srv.start()
    yield srv
    srv.stop()
