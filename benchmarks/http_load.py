"""What the HTTP benchmarks share: a server process that answers before it is loaded, and
wrk's load and report."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

_READY_TIMEOUT = 60.0


@dataclass
class Cell:
    """Repeated wrk runs of one endpoint in one configuration."""

    rates: list[float] = field(default_factory=list)
    exact: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)


@dataclass(frozen=True)
class Load:
    """What wrk reported of one run."""

    completed: int
    rate: float
    failed: int
    """Non-2xx responses and socket errors (connect, read, write, timeout)."""


def parse_wrk(output: str) -> Load:
    completed = int(re.search(r"(\d+) requests in", output).group(1))  # type: ignore[union-attr]
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))  # type: ignore[union-attr]
    failed = sum(
        int(n)
        for n in re.findall(
            r"(?:Non-2xx or 3xx responses:|connect|read|write|timeout) (\d+)", output
        )
    )
    return Load(completed, rate, failed)


def wrk(url: str, connections: int, seconds: float, *, script: str | None = None) -> Load:
    """Load ``url`` with wrk (``script``: a Lua file of wrk's, e.g. to POST)."""
    threads = min(2, connections)
    command = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", url]
    if script is not None:
        command[1:1] = ["-s", script]
    return parse_wrk(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(command: list[str], env: dict[str, str], port: int, ready: str) -> Iterator[str]:
    """The server ``command`` (listening on ``port``); yields its base URL once a GET of
    ``ready`` answers 200, and stops it (SIGTERM, then SIGKILL) afterwards."""
    server = subprocess.Popen(command, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _READY_TIMEOUT
        while True:
            try:
                with urllib.request.urlopen(f"{base}{ready}", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{command[2]} did not start serving") from None
                time.sleep(0.1)
        yield base
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
