"""Real ``celery worker`` processes for the tests (importing ``celery_app``), and the
configuration a test's workers and kits share."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from backends import (
    CELERY_BROKERS,
    PREFIX,
    SUPPORT,
    redis_database,
    require,
    require_broker,
    store_url_for,
    wait_for,
)
from celery_app import Config
from hosts import Host

# Database 10 keeps the workers' records and is the kits' cache.
CACHE = os.environ.get("SHARDKIT_TEST_CELERY_CACHE", redis_database(10))
STARTUP = 30.0  # seconds a worker may take to be ready
DEADLINE = 15.0  # seconds a worker may take to stop


class Workers:
    """The ``celery worker`` processes a test starts, each in a session of its own (so
    that one and its pool children can be ended together); every one is ended at the
    end of the test."""

    def __init__(self, config: Config, records: redis.Redis, logs: Path) -> None:
        self.config = config
        self.records = records
        self.logs = logs
        self.started: list[subprocess.Popen[bytes]] = []
        self.beats: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        pool: str = "prefork",
        fault: str = "",
        env: Mapping[str, str] | None = None,
        host: Host | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a worker (with ``env`` added to its environment; on ``host``, if given)
        and wait until it is ready to consume (or, with a fault, for it to be killed
        already: a worker may run a task before it says it is ready)."""
        number = len(self.started)
        config = replace(self.config, fault=fault)
        env = {**self._environ(config), **(env or {})}
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "celery_app",
            "worker",
            f"--pool={pool}",
            "--concurrency=1",
            "-Q",
            config.queue,
            "-n",
            f"{config.queue}-{number}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "warning",
        ]
        with open(self.logs / f"worker-{number}.log", "wb") as log:
            process = subprocess.Popen(
                host.command(command) if host is not None else command,
                cwd=SUPPORT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append(process)

        def ready() -> bool:
            if process.poll() is not None:
                if fault and process.returncode == -signal.SIGKILL:
                    return True
                pytest.fail(f"worker {number} exited with {process.returncode}\n{self.status()}")
            return str(process.pid).encode() in self.records.lrange(config.key("ready"), 0, -1)

        wait_for(ready, f"worker {number} to be ready", STARTUP, self.status)
        return process

    def beat(self) -> subprocess.Popen[bytes]:
        """Start ``celery beat`` on the app's schedule (its log: ``beat.log``)."""
        command = [sys.executable, "-m", "celery", "-A", "celery_app", "beat"]
        command += ["-s", str(self.logs / "beat-schedule"), "--pidfile=", "-l", "info"]
        with open(self.logs / "beat.log", "wb") as log:
            process = subprocess.Popen(
                command,
                cwd=SUPPORT,
                env=self._environ(self.config),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.beats.append(process)
        return process

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        """Cold shutdown (SIGQUIT: the tasks it holds go back to the broker, unacknowledged;
        nothing to wait for), then SIGKILL of its whole session if that takes too long."""
        if process.poll() is None:
            process.send_signal(signal.SIGQUIT)
            try:
                process.wait(DEADLINE)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    @staticmethod
    def _environ(config: Config) -> dict[str, str]:
        """A Celery process' environment: ``config``'s, and this directory importable."""
        path = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))
        # Not Django workers: pytest-django has put the tests' site settings in the
        # environment, and Celery would set Django up for a worker that has them.
        inherited = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
        return {**inherited, **config.environ(), "PYTHONPATH": path}

    def stop_all(self) -> None:
        for process in self.beats:
            process.terminate()
            try:
                process.wait(DEADLINE)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for process in self.started:
            self.stop(process)
            with contextlib.suppress(ProcessLookupError):  # children of a killed master
                os.killpg(process.pid, signal.SIGKILL)

    def status(self) -> str:
        """The end of every worker's log, for failure messages."""
        texts = []
        for number in range(len(self.started)):
            text = (self.logs / f"worker-{number}.log").read_text(errors="replace")
            texts.append(f"--- worker {number} ---\n{text[-3000:]}")
        if self.beats:
            text = (self.logs / "beat.log").read_text(errors="replace")
            texts.append(f"--- beat ---\n{text[-3000:]}")
        return "\n" + "\n".join(texts)


def config_for(broker_name: str, sqlite_url: str, tag: str) -> Config:
    """A test's worker configuration on the PostgreSQL store, with a queue and record
    prefix of its own (its services required)."""
    broker = CELERY_BROKERS[broker_name]
    require_broker(broker)
    require(CACHE)
    run = uuid.uuid4().hex[:12]
    return Config(
        store=store_url_for("postgres", sqlite_url),
        cache=CACHE,
        prefix=PREFIX,
        broker=broker,
        queue=f"shardkit-test-{run}",
        record=f"shardkit-test:{tag}:{run}",
    )
