"""`ember serve` in a real subprocess, as a user starts it: the console script, its log in a file (never a pipe that
nobody drains: a full pipe would block the server), and its URL once /health answers."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from ember.server.app import free_port


def ember_cmd() -> list[str]:
    exe = shutil.which("ember", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "ember.server.cli"]


@dataclass
class ServeProcess:
    url: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextmanager
def serving(args: list[str], log: Path, env: dict | None = None, timeout: float = 180,
            verify: str | None = None) -> Iterator[ServeProcess]:
    """`ember serve ARGS` until the block ends (terminated then); yields once /health answers 200 (over HTTPS,
    checked against the CA file ``verify``, when given)."""
    port = free_port()
    with open(log, "w") as err:
        proc = subprocess.Popen([*ember_cmd(), "serve", *args, "--port", str(port)], stdout=subprocess.DEVNULL,
                                stderr=err, env={**os.environ, **(env or {})})
    served = ServeProcess(f"{'https' if verify else 'http'}://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, served.log_tail()
            try:
                if httpx.get(served.url + "/health", timeout=2, verify=verify or True).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "ember serve did not come up:\n" + served.log_tail()
            time.sleep(0.2)
        yield served
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
