"""Several hosts on this machine, for the tests that need a network between processes:
each host is a Linux network namespace with one address, joined to the others (and to
the test process, which stays in the machine's own namespace) by a bridge of the test's
own.

A host runs what a deployment would run on it: ``Host.command`` wraps a program so that
it starts inside the host (``ip netns exec``), and ``servers.Server.placed(host)`` puts
a throwaway server there, listening on the host's address. A test can

* **partition** a host (``partition()``/``heal()``): its link goes down, so nothing it
  sends arrives and nothing reaches it, while its processes run on; connections stall
  and resume, as across a real network split;
* **kill** a host (``kill()``): its link goes down first, then every process in it is
  SIGKILLed, so no goodbye (FIN, RST) leaves it, as when a machine loses power; the
  peers find out only by their timeouts. ``heal()`` brings the link back; its servers
  start again with ``start()``.

Hosts need root and ``ip`` (iproute2): without them the tests skip, and fail under
CI=true. Names and addresses are the test's own (a /24 in 10.200.0.0/13 that no link of
the machine uses), and ``close()`` removes every namespace, link and process, whatever
happened.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from backends import CI

_LOCK = Path(tempfile.gettempdir()) / "shardkit-hosts.lock"  # subnets are drawn under it


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "ip (iproute2) is not installed"
    return None


def require_hosts() -> None:
    """Skip the calling test (fail it under CI=true) where hosts cannot be made."""
    reason = _missing()
    if reason is not None:
        if CI:
            pytest.fail(f"required in CI: {reason}")
        pytest.skip(reason)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(pid) for pid in done.stdout.split()]


class Host:
    """One host: the namespace ``name``, reached at ``address``; ``link`` is its end of
    the wire in the machine's namespace (down while it is partitioned or dead)."""

    def __init__(self, name: str, link: str, address: str) -> None:
        self.name, self.link, self.address = name, link, address

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address})"

    def command(self, argv: Sequence[str], user: str | None = None) -> list[str]:
        """``argv`` run inside this host (as the OS ``user``, if given)."""
        prefix = ["ip", "netns", "exec", self.name]
        if user is not None:
            prefix += ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"]
        return [*prefix, *argv]

    def partition(self) -> None:
        """Cut the host off: nothing it sends arrives, nothing reaches it."""
        _ip("link", "set", self.link, "down")

    def heal(self) -> None:
        """Join the host to the others again."""
        _ip("link", "set", self.link, "up")

    def kill(self) -> None:
        """Cut the host off, then SIGKILL every process in it and wait until none is
        left: what its peers see of a machine that lost power."""
        self.partition()
        for _ in range(100):
            pids = _pids(self.name)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        raise RuntimeError(f"processes of {self.name} survive SIGKILL: {_pids(self.name)}")

    def reaches(self, address: str, port: int) -> bool:
        """Whether a TCP connection from this host to ``address:port`` is accepted now."""
        probe = f"import socket; socket.create_connection(({address!r}, {port}), timeout=1)"
        done = subprocess.run(
            self.command(["python3", "-c", probe]), capture_output=True, timeout=30
        )
        return done.returncode == 0


class Hosts:
    """``count`` hosts joined by a bridge, the test process on it as well (at ``.1``).
    ``start()`` makes them, ``close()`` removes them with every process in them."""

    def __init__(self, count: int) -> None:
        require_hosts()
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"sk{self.tag}br"
        self.subnet = ""
        self.hosts: list[Host] = []
        self.count = count

    def __getitem__(self, number: int) -> Host:
        return self.hosts[number]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def start(self) -> None:
        with open(_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two sessions never draw the same subnet
            self.subnet = self._free_subnet()
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for number in range(self.count):
            name = f"sk{self.tag}h{number}"
            host = Host(name, name, f"{self.subnet}.{10 + number}")
            self.hosts.append(host)
            inside = f"sk{self.tag}i{number}"
            _ip("netns", "add", host.name)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", host.name)
            _ip("link", "set", host.link, "master", self.bridge, "up")
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", inside)
            _ip("-n", host.name, "link", "set", inside, "up")
            _ip("-n", host.name, "link", "set", "lo", "up")

    @staticmethod
    def _free_subnet() -> str:
        used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
        while True:
            subnet = f"10.{random.randint(200, 207)}.{random.randint(0, 255)}"
            if f" {subnet}." not in used:
                return subnet

    def close(self) -> None:
        for host in self.hosts:
            with contextlib.suppress(RuntimeError):
                host.kill()
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", host.name)
            with contextlib.suppress(RuntimeError):
                _ip("link", "del", host.link)  # gone with the namespace, unless it failed
        with contextlib.suppress(RuntimeError):
            _ip("link", "del", self.bridge)
