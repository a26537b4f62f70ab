"""Throwaway servers for the tests that break or route around one: a PostgreSQL cluster
made by ``initdb``, a ``redis-server``, a ``memcached`` and a PgBouncer in front of a
PostgreSQL server, each a child process of the test listening on a free loopback port,
stopped and started again on that same port, and killed at the end whatever happened
(the machine's shared servers are never touched).

A server is started with ``setpriv --pdeathsig`` where that exists, so it dies with the
*thread* that started it even if the test process is killed: start and restart servers
from the test's own thread, never from a helper thread that ends first.

``Cutter`` is a proxy in the test's process that cuts Redis connections.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import psycopg
import pytest
import redis
from pymemcache.client.base import Client as MemcacheClient
from sqlalchemy.engine import make_url

from backends import CI, free_port, wait_for
from shardkit.errors import BackendUnavailable

if TYPE_CHECKING:
    from hosts import Host

STARTUP = 30.0  # seconds a server may take to answer (PostgreSQL replays its WAL)
SHUTDOWN = 15.0  # seconds a server may take to exit before it is SIGKILLed
WRITERS = 8  # threads of a Writers
PAUSE = 0.005  # seconds a writer waits after a failed call
DEADLINE = 60.0  # seconds a writer's progress or failure is awaited
_ROOT = os.geteuid() == 0


def unavailable(reason: str) -> None:
    """Skip the calling test (fail it under CI=true) for a missing server binary."""
    if CI:
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)


P = TypeVar("P", bound="Server")


class _PortTaken(Exception):
    """A server's first start found its port taken by another process."""


class Server:
    """One server process on 127.0.0.1:``port``, with its files in a temporary directory.

    ``start()`` returns once the server answers (that moment, ``time.monotonic()``),
    ``stop()`` ends it (``stop_signal``; SIGKILL past ``SHUTDOWN`` seconds), ``restart()``
    does both on the same port, ``up()`` starts it if it is not running, ``close()`` ends
    it and removes its files.
    """

    name = "server"
    stop_signal = signal.SIGKILL
    user: str | None = None  # run as this OS user when the tests run as root
    address = "127.0.0.1"  # where it listens: its host's address once placed on one
    host: Host | None = None

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"shardkit-{self.name}-"))
        if self.user and _ROOT:
            shutil.chown(self.dir, self.user)
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._answered = False  # once: later starts keep the port (restarts)

    @property
    def url(self) -> str:
        raise NotImplementedError

    def placed(self: P, host: Host, port: int | None = None) -> P:
        """This server, run on ``host`` (a network namespace) from its next start, on
        ``port`` if given (the host's ports are its own: a well-known one is free)."""
        self.host, self.address = host, host.address
        self.port = port or self.port
        return self

    def command(self) -> list[str]:
        raise NotImplementedError

    def answers(self) -> bool:
        """Whether the server answers a request now (one probe, failing fast)."""
        raise NotImplementedError

    @property
    def log(self) -> Path:
        return self.dir / f"{self.name}.log"

    def status(self) -> str:
        """The end of the server's log, for failure messages."""
        try:
            return "\n" + self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def _other_port(self) -> int:
        """A port for a first start whose port another process took meanwhile (a free
        port is only free until someone binds it: another test worker may)."""
        return free_port()

    def start(self) -> float:
        """Start the server and wait until it answers; return that moment. A first start
        whose port another process took meanwhile (the server exits, the port busy) is
        made again on another port, twice at most."""
        for _ in range(2):
            try:
                return self._start()
            except _PortTaken:
                self.port = self._other_port()
        return self._start()

    def _start(self) -> float:
        assert self.process is None or self.process.poll() is not None, "already running"
        prefix = []
        if shutil.which("setpriv"):
            prefix = ["setpriv", f"--pdeathsig={signal.Signals(self.stop_signal).name[3:]}"]
        user = self.user if self.user and _ROOT else None
        command = [*prefix, *self.command()]
        if self.host is not None:  # a change of user clears the death signal: it comes after
            command, user = self.host.command(command, user), None
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command,
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                user=user,
                start_new_session=True,  # a ^C of the test run is not sent to it
            )
        deadline = time.monotonic() + STARTUP
        while not self.answers():
            if self.process.poll() is not None:
                if not self._answered and self.host is None and not _free(self.port):
                    raise _PortTaken(self.port)
                pytest.fail(f"{self.name} exited with {self.process.returncode}{self.status()}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{self.name} did not answer within {STARTUP:.0f} s{self.status()}")
            time.sleep(0.01)
        self._answered = True
        return time.monotonic()

    def stop(self) -> None:
        """End the server (its ``stop_signal``; SIGKILL past ``SHUTDOWN`` seconds) and
        wait until it has exited."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(self.stop_signal)
        try:
            process.wait(SHUTDOWN)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    @contextlib.contextmanager
    def silent(self) -> Iterator[None]:
        """The server's processes stopped (SIGSTOP) for the block: its connections stay
        open and its host acknowledges what is sent on them, but nothing answers, as a
        server hung or failing over; they go on (SIGCONT) when the block exits,
        however."""
        assert self.process is not None, "never started"
        assert self.process.poll() is None, "not running"
        os.kill(self.process.pid, signal.SIGSTOP)  # first: it starts no other meanwhile
        # Then the processes it started, which may have left its session (PostgreSQL's).
        stopped = [self.process.pid, *_descendants(self.process.pid)]
        for pid in stopped[1:]:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def up(self) -> Server:
        """This server, started again if it is not running."""
        if self.process is None or self.process.poll() is not None:
            self.start()
        return self

    def restart(self) -> float:
        """Stop the server and start it again on the same port; return when it answered."""
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):  # anything it left in its session
                os.killpg(self.process.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def _descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs, from ``/proc``."""
    children = [
        int(child)
        for task in Path(f"/proc/{pid}/task").glob("*")
        for child in (task / "children").read_text().split()
    ]
    return [found for child in children for found in (child, *_descendants(child))]


class PostgresServer(Server):
    """A cluster of its own (``initdb``, trust authentication, user ``postgres``), its
    socket in its directory. Stopped by immediate shutdown (SIGQUIT: backends die at
    once, the next start replays the WAL, as after a crash); ``fsync`` is off, since
    only the server process dies, never the machine."""

    name = "postgres"
    stop_signal = signal.SIGQUIT
    user = "postgres"

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            unavailable("PostgreSQL's initdb is not installed (/usr/lib/postgresql/*/bin)")
        if _ROOT:  # PostgreSQL refuses to run as root
            try:
                pwd.getpwnam(self.user)
            except KeyError:
                unavailable(f"no OS user {self.user!r} to run PostgreSQL as")
        self.bin = Path(found[-1]).parent
        super().__init__()
        data = self.dir / "data"
        initdb = [self.bin / "initdb", "-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8"]
        try:
            subprocess.run(
                [*initdb, "--no-sync", "--no-instructions"],
                check=True,
                capture_output=True,
                user=self.user if _ROOT else None,
                timeout=STARTUP,
            )
        except subprocess.SubprocessError as exc:
            shutil.rmtree(self.dir, ignore_errors=True)
            output = getattr(exc, "stderr", None) or b""
            pytest.fail(f"initdb failed: {exc}\n{output.decode(errors='replace')}")
        with open(data / "pg_hba.conf", "a") as hba:  # the hosts of its network, placed on one
            hba.write("host all all samenet trust\n")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@{self.address}:{self.port}/postgres"

    def command(self) -> list[str]:
        return [
            str(self.bin / "postgres"),
            *("-D", str(self.dir / "data"), "-p", str(self.port), "-k", str(self.dir)),
            *("-c", f"listen_addresses={self.address}", "-c", "fsync=off"),
            *("-c", "max_connections=40", "-c", "shared_buffers=16MB"),
            # A client whose host died is dropped within seconds, and the locks of its
            # transaction with it: what a deployment over several hosts sets.
            *("-c", "tcp_keepalives_idle=2", "-c", "tcp_keepalives_interval=1"),
            *("-c", "tcp_keepalives_count=3", "-c", "tcp_user_timeout=5000"),
        ]

    def answers(self) -> bool:
        try:
            with psycopg.connect(self.url.replace("+psycopg", ""), connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False


class RedisServer(Server):
    """redis-server without persistence: a restart loses every key, as a cache may."""

    name = "redis"

    def __init__(self) -> None:
        if not shutil.which("redis-server"):
            unavailable("redis-server is not installed")
        super().__init__()

    @property
    def url(self) -> str:
        return f"redis://{self.address}:{self.port}/0"

    def command(self) -> list[str]:
        return [
            "redis-server",
            *("--port", str(self.port), "--bind", self.address, "--dir", str(self.dir)),
            *("--save", "", "--appendonly", "no", "--daemonize", "no"),
            *("--protected-mode", "no"),  # clients come from other hosts, without a password
        ]

    def answers(self) -> bool:
        """It answers, and it is this server's process (on this machine's loopback, a
        server another test started on the same port is not)."""
        client = redis.Redis(self.address, self.port, socket_timeout=2, socket_connect_timeout=2)
        try:
            pid = int(client.info("server")["process_id"])
        except redis.RedisError:
            return False
        finally:
            client.close()
        return self.host is not None or self.process is None or pid == self.process.pid


class ClusterNode(RedisServer):
    """A redis-server of a Redis Cluster (its bus on port + 10000), that fails over
    quickly: a primary missed for ``NODE_TIMEOUT_MS`` is replaced by its replica, and
    the slots of the other primaries stay served meanwhile."""

    name = "redis-cluster-node"
    NODE_TIMEOUT_MS = 1000

    def __init__(self, taken: set[int]) -> None:
        """``taken``: the ports (and bus ports) of the other nodes of its cluster, which
        may not be listening yet; this node's are added."""
        super().__init__()
        self._taken = taken
        self.port = self._other_port()

    def _other_port(self) -> int:
        """A free port whose bus port is free too, neither of them the cluster's."""
        taken, port = self._taken, self.port
        while {port, port + 10000} & taken or port > 55535 or not _free(port + 10000):
            port = free_port()
        taken |= {port, port - 10000, port + 10000}
        return port

    def command(self) -> list[str]:
        return [
            *super().command(),
            *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
            *("--cluster-node-timeout", str(self.NODE_TIMEOUT_MS)),
            *("--cluster-replica-validity-factor", "0", "--cluster-require-full-coverage", "no"),
            # A primary drops a replica gone silent within 5 s: until then its ids and
            # monotonic values wait for that replica (docs/deploying.md).
            *("--repl-ping-replica-period", "1", "--repl-timeout", "5"),
        ]

    def client(self) -> redis.Redis:
        return redis.Redis(self.address, self.port, socket_timeout=2, socket_connect_timeout=2)

    def info(self, command: str) -> dict[str, Any]:
        """``CLUSTER INFO`` or ``INFO <section>``, parsed (empty if it does not answer)."""
        client = self.client()
        try:
            text = client.execute_command(*command.split())
        except redis.RedisError:
            return {}
        finally:
            client.close()
        if isinstance(text, dict):
            return {str(k): v for k, v in text.items()}
        lines = text.decode() if isinstance(text, bytes) else str(text)
        return dict(line.split(":", 1) for line in lines.splitlines() if ":" in line)


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class RedisClusterServers:
    """A Redis Cluster of its own: ``masters`` primaries with ``replicas`` replicas each,
    made by ``redis-cli --cluster create`` on free loopback ports, or spread over
    ``hosts`` (node ``i`` on host ``i % len(hosts)``; each replica on another host than
    its primary where the hosts allow it: redis-cli places them so). ``start()`` returns
    once every slot is served and every primary has its replicas; ``kill(node)``
    SIGKILLs a node; ``wait_healthy()`` waits until the cluster serves every slot again
    (a replica promoted); ``close()`` ends every node and removes its files."""

    def __init__(self, masters: int = 3, replicas: int = 1, hosts: Sequence[Host] = ()) -> None:
        if not shutil.which("redis-cli"):
            unavailable("redis-cli is not installed")
        self.masters, self.replicas = masters, replicas
        taken: set[int] = set()
        self.nodes = [ClusterNode(taken) for _ in range(masters * (1 + replicas))]
        for number, node in enumerate(self.nodes):
            if hosts:
                node.placed(hosts[number % len(hosts)])

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{n.address}:{n.port}" for n in self.nodes)

    def on(self, host: Host) -> list[ClusterNode]:
        """The nodes placed on ``host``."""
        return [node for node in self.nodes if node.host is host]

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        create = ["redis-cli", "--cluster", "create"]
        create += [f"{node.address}:{node.port}" for node in self.nodes]
        create += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        made = subprocess.run(create, capture_output=True, text=True, timeout=60)
        if made.returncode != 0:
            pytest.fail(f"redis-cli --cluster create failed: {made.stdout}{made.stderr}")
        self.wait_healthy()
        self.wait_replicating()

    def wait_replicating(self, timeout: float = 60.0) -> None:
        """Wait until a write to each primary is acknowledged by a replica (``WAIT``):
        a replica is "online" before its first full sync is done."""
        from redis.cluster import RedisCluster

        client = RedisCluster(host=self.nodes[0].address, port=self.nodes[0].port)
        try:
            for primary in client.get_primaries():
                key = next(k for k in map(str, range(100_000))
                           if client.get_node_from_key(k).name == primary.name)  # fmt: skip
                pipe = client.get_redis_connection(primary).pipeline(transaction=False)

                def acked(key: str = key, pipe: Any = pipe) -> bool:
                    pipe.set(key, 1).wait(1, 100)
                    return bool(pipe.execute()[1])

                wait_for(acked, f"a replica of {primary.name} to acknowledge", timeout)
        finally:
            client.close()

    def alive(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def primaries(self) -> list[ClusterNode]:
        """The live nodes that are primaries now."""
        return [n for n in self.alive() if n.info("INFO replication").get("role") == "master"]

    def healthy(self) -> bool:
        """Every live node sees the cluster ok, with ``masters`` primaries, and gives
        every slot to a live node (a node that has not yet heard of a failover is ok but
        still names the dead primary); when every node is alive, each primary has its
        replicas connected."""
        nodes = self.alive()
        if not all(n.info("CLUSTER INFO").get("cluster_state") == "ok" for n in nodes):
            return False
        live = {f"{n.address}:{n.port}" for n in nodes}
        if not all(self._serving(n) <= live for n in nodes):
            return False
        primaries = self.primaries()
        if len(primaries) != self.masters:
            return False
        if len(nodes) < len(self.nodes):
            return True
        replicated = (int(n.info("INFO replication").get("connected_slaves", 0)) for n in primaries)
        return all(count >= self.replicas for count in replicated)

    @staticmethod
    def _serving(node: ClusterNode) -> set[str]:
        """The addresses of the nodes ``node`` gives slots to (none if it does not
        answer)."""
        client = node.client()
        try:
            ranges = client.execute_command("CLUSTER", "SLOTS")
        except redis.RedisError:
            return {"?"}
        finally:
            client.close()
        if isinstance(ranges, dict):  # parsed by redis-py: {(start, end): {"primary": ...}}
            return {f"{r['primary'][0]}:{r['primary'][1]}" for r in ranges.values()}
        return {f"{r[2][0].decode()}:{r[2][1]}" for r in ranges}

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                statuses = "".join(node.status() for node in self.nodes)
                pytest.fail(f"the Redis Cluster did not become healthy{statuses}")
            time.sleep(0.1)

    def kill(self, node: ClusterNode) -> None:
        node.stop()  # SIGKILL

    def close(self) -> None:
        for node in self.nodes:
            node.close()


class MemcachedServer(Server):
    """memcached: a restart loses every key."""

    name = "memcached"

    def __init__(self) -> None:
        if not shutil.which("memcached"):
            unavailable("memcached is not installed")
        super().__init__()

    @property
    def url(self) -> str:
        return f"memcached://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        root = ["-u", "root"] if _ROOT else []
        return ["memcached", *root, "-l", "127.0.0.1", "-p", str(self.port), "-U", "0"]

    def answers(self) -> bool:
        client = MemcacheClient(("127.0.0.1", self.port), connect_timeout=2, timeout=2)
        try:
            client.version()
            return True
        except Exception:  # pymemcache has errors of its own beside OSError
            return False
        finally:
            client.close()


class PgBouncerServer(Server):
    """PgBouncer (Debian's package) in front of the PostgreSQL server of ``upstream``,
    any database on it, trusted, in ``pool_mode``; ``url`` is ``upstream`` through it."""

    name = "pgbouncer"
    stop_signal = signal.SIGTERM
    user = "postgres"  # PgBouncer refuses to run as root

    def __init__(self, upstream: str, pool_mode: str = "transaction") -> None:
        program = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
        if program is None:
            unavailable("pgbouncer is not installed (.ci/run installs it with apt)")
        if _ROOT:
            try:
                pwd.getpwnam(self.user)
            except KeyError:
                unavailable(f"no OS user {self.user!r} to run PgBouncer as")
        self.program = str(program)
        self.upstream = make_url(upstream)
        super().__init__()
        users = self.dir / "users.txt"
        users.write_text(f'"{self.upstream.username}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            f"[databases]\n* = host={self.upstream.host} port={self.upstream.port or 5432}\n"
            f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"unix_socket_dir =\nauth_type = trust\nauth_file = {users}\n"
            f"pool_mode = {pool_mode}\nmax_client_conn = 500\ndefault_pool_size = 20\n"
        )

    @property
    def url(self) -> str:
        return self.upstream.set(port=self.port).render_as_string(hide_password=False)

    def command(self) -> list[str]:
        return [self.program, str(self.dir / "pgbouncer.ini")]

    def answers(self) -> bool:
        dsn = make_url(self.url).set(drivername="postgresql").render_as_string(False)
        try:
            with psycopg.connect(dsn, connect_timeout=2, autocommit=True) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False


class Startable(Protocol):
    def start(self) -> object: ...
    def close(self) -> None: ...


S = TypeVar("S", bound=Startable)


@contextlib.contextmanager
def running(kind: Callable[..., S], *args: Any) -> Iterator[S]:
    """A started server (or cluster) of ``kind`` (made with ``args``), ended and removed
    when the block exits, however."""
    server = kind(*args)
    try:
        server.start()
        yield server
    finally:
        server.close()


class Writers:
    """``count`` threads, each calling ``write(slot)`` again and again until stopped,
    recording what every call did: returned (when), or raised (what)."""

    def __init__(
        self, write: Callable[[int], object], count: int = WRITERS, pause: float = PAUSE
    ) -> None:
        self.write = write
        self.pause = pause
        self.done = threading.Event()
        self.acked = [0] * count
        self.ok_at: list[list[float]] = [[] for _ in range(count)]
        self.errors: list[list[BaseException]] = [[] for _ in range(count)]
        # Each call's start (time.monotonic()) and whether it returned.
        self.calls: list[list[tuple[float, bool]]] = [[] for _ in range(count)]
        self.threads = [threading.Thread(target=self._run, args=(s,)) for s in range(count)]

    def _run(self, slot: int) -> None:
        while not self.done.is_set():
            began = time.monotonic()
            try:
                self.write(slot)
            except Exception as exc:  # recorded: the test checks what was raised
                self.errors[slot].append(exc)
                self.calls[slot].append((began, False))
                time.sleep(self.pause)
            else:
                self.acked[slot] += 1
                self.ok_at[slot].append(time.monotonic())
                self.calls[slot].append((began, True))

    def __enter__(self) -> Writers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(DEADLINE)
        assert not any(thread.is_alive() for thread in self.threads), "a writer hangs"

    def status(self) -> str:
        return f"(acked {self.acked}, errors {[len(e) for e in self.errors]})"

    def wait_acked(self, more: int) -> None:
        """Wait until every writer has had ``more`` more calls return."""
        wanted = [n + more for n in self.acked]
        wait_for(
            lambda: all(n >= w for n, w in zip(self.acked, wanted, strict=True)),
            f"{more} more writes of every writer",
            DEADLINE,
            self.status,
        )

    def wait_failed(self, slots: range | None = None) -> None:
        """Wait until every writer of ``slots`` (all) has had a call raise since now."""
        slots = slots or range(len(self.threads))
        seen = [len(self.errors[slot]) for slot in slots]
        wait_for(
            lambda: all(len(self.errors[s]) > n for s, n in zip(slots, seen, strict=True)),
            f"a failed call of writers {slots}",
            DEADLINE,
            self.status,
        )

    def raised(self) -> list[BaseException]:
        return [exc for errors in self.errors for exc in errors]

    def check_errors(self) -> None:
        """Some calls raised (the outage was seen), and every one raised
        ``BackendUnavailable``: the server could not be reached, or was lost mid-call."""
        raised = self.raised()
        assert raised, "no call failed: the outage was not seen"
        wrong = [exc for exc in raised if not isinstance(exc, BackendUnavailable)]
        assert not wrong, f"{len(wrong)} calls raised something else, e.g. {wrong[0]!r}"

    def failed_after(self, answered_at: float) -> list[int]:
        """For each writer, its calls begun at or after ``answered_at`` that raised before
        one returned."""
        counts = []
        for calls in self.calls:
            after = [ok for began, ok in calls if began >= answered_at]
            counts.append(after.index(True) if True in after else len(after))
        return counts


class PrometheusServer(Server):
    """Debian's ``prometheus``, scraping ``targets`` (``host:port``) every second and
    evaluating ``rules`` every second, its TSDB in its directory. ``query(expr, at)``
    evaluates PromQL through its HTTP API."""

    name = "prometheus"
    stop_signal = signal.SIGTERM

    def __init__(self, targets: list[str], rules: Path) -> None:
        if not shutil.which("prometheus"):
            unavailable("prometheus is not installed (Debian's package 'prometheus')")
        super().__init__()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": "shardkit", "static_configs": [{"targets": targets}]},
            ],
        }
        (self.dir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            "prometheus",
            f"--config.file={self.dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: object) -> Any:
        """The ``data`` of ``GET /api/v1/{path}?{params}``; fails the test on an error."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as response:
            answer = json.load(response)
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str, at: float) -> dict[frozenset[tuple[str, str]], float]:
        """``expr`` evaluated at time ``at``: each series' value by its labels (without
        ``__name__``)."""
        data = self.api("query", query=expr, time=f"{at:.3f}")
        if data["resultType"] == "scalar":
            return {frozenset(): float(data["result"][1])}
        return {
            frozenset(
                (label, value) for label, value in series["metric"].items() if label != "__name__"
            ): float(series["value"][1])
            for series in data["result"]
        }


class Cutter:
    """A TCP proxy in front of Redis that can break its clients' connections: ``arm(word)``
    closes the connection of the next command holding ``word`` in place of forwarding its
    reply (the server applied it; the client never hears so); ``drop()`` closes every
    connection open now, as a server restart would; ``hold()`` forwards nothing more
    either way, on the connections open and on those made after (counted in ``held``),
    as if the server's host were cut off."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._word: bytes | None = None
        self._holding = False
        self.held = 0  # connections made while holding
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, word: bytes) -> None:
        self._word = word

    def hold(self) -> None:
        self._holding = True

    def drop(self) -> None:
        with self._lock:
            for sock in self._open:
                _close(sock)
            self._open.clear()

    def close(self) -> None:
        self._listener.close()
        self.drop()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            with self._lock:
                self._open += [client, server]
                self.held += self._holding
            cut = threading.Event()  # this connection sent the armed word
            threading.Thread(target=self._up, args=(client, server, cut), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, cut), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, cut: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self._holding:
                    continue
                if self._word is not None and self._word in data:
                    self._word = None
                    cut.set()  # before the server can answer
                server.sendall(data)
        _close(server)

    def _down(self, server: socket.socket, client: socket.socket, cut: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while (data := server.recv(65536)) and not cut.is_set():
                if not self._holding:
                    client.sendall(data)
        _close(client)
        _close(server)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
