"""Start a specd process on a free localhost port and wait until its gateway answers."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class SpecdProcess:
    proc: subprocess.Popen
    base_url: str
    run_dir: str
    log_path: str

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], ready_timeout_s: float = 60.0) -> SpecdProcess:
    """``argv`` runs specd's serve command; --run-dir, --http-port and --log-level are appended."""
    run_dir = tempfile.mkdtemp(prefix="specd-", dir="/tmp")
    port = free_port()
    log_path = os.path.join(run_dir, "specd.log")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, *argv, "--run-dir", run_dir, "--http-port", str(port),
                                 "--log-level", "warning"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    sp = SpecdProcess(proc, f"http://127.0.0.1:{port}", run_dir, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"specd exited with {proc.returncode}:\n{sp.log()}")
        try:
            if http_call(sp.base_url + "/v1/models", timeout_s=1.0)[0] == 200:
                return sp
        except OSError:
            pass
        time.sleep(0.2)
    stop(sp)
    raise RuntimeError(f"specd did not become ready in {ready_timeout_s}s:\n{sp.log()}")


def stop(sp: SpecdProcess) -> None:
    sp.proc.terminate()
    try:
        sp.proc.wait(10)
    except subprocess.TimeoutExpired:
        sp.proc.kill()
        sp.proc.wait()
    shutil.rmtree(sp.run_dir, ignore_errors=True)


def http_call(url: str, body: bytes | dict | None = None, timeout_s: float = 10.0) -> tuple[int, str]:
    """(status, text) of a GET (no body) or a POST; HTTP errors are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def read_stream_then_hang_up(base_url: str, path: str, body: dict, lines: int) -> list[str]:
    """POST a streaming request, read ``lines`` non-empty SSE lines, then close the connection."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    got: list[str] = []
    while len(got) < lines:
        line = resp.readline().decode().strip()
        if line:
            got.append(line)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    return got
