"""The hot paths of one revision of shardkit, run in that revision's own environment for
``compare.py``, which starts one of these per revision and tells it what to run.

* sharded  - ``kit.sharded(name, shards=32).incr()`` from ``--writers`` processes
* buffered - ``kit.buffered(name, interval).incr()`` from as many, on the Redis cache
* ids      - ``kit.ids(name).next()`` from as many, sharing the Redis cache
* django   - ``Hit.objects.filter(pk=pk).update(views=F("views") + 1)`` on a
             ``ShardedCount(shards=32)`` (``compare_app``), from as many
* map      - ``kit.map(table, fn, transactional=True)`` over ``--rows`` rows, ``fn`` adding 1
             to each row's balance through ``batch.conn``; one job, this process

Only the public API that every revision since 3afbc35 (2026-11-28) shares is used, so an
old revision runs the same code as a new one; a path whose API a revision lacks is
reported missing. The writer processes are the harness's ``Crew``, spawned with this
environment's Python. Every round is checked as the other benchmarks check theirs: the
counter moved by exactly the acknowledged writes (the buffered one once flushed), no id
handed out twice and each counted, every row of the mapped table visited exactly once.

The protocol, one JSON object a line: ``{"op": "prepare", "paths": [...]}`` answers the
revision (``version``, ``file``) and each path's state (``null``: ready, or why not);
``{"op": "run", "path": P, "seconds": S}`` answers one round (``rate``, ``ops``,
``cpu_per_op``, ``exact``, ``detail``) or an ``error``; ``{"op": "close"}`` deletes the
run's Redis keys and ends. Answers go to the standard output this process was started
with; anything else printed there (by it or its writers) goes to the standard error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import sqlalchemy as sa

import shardkit
from compare_app import SHARDS
from harness import Crew, Op, Phase, Reports, Setup, Tally, forget_redis_keys

PATHS = ("sharded", "buffered", "ids", "django", "map")
PREFIX = "cmp_"
"""The tables of this driver's kits (the Django app's are ``shardkit_``, made by its
migrations: the two never share a table)."""
TABLE = "cmp_accounts"
MISSING = (ImportError, AttributeError, TypeError)
"""What using an API that a revision lacks raises."""
JOB_TIMEOUT = 600.0
STARTING = 900.0
"""Seconds the writer processes may take to start: 16 of each revision importing at once
on a shared 2-core machine have taken over 120."""

Outcome = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """What a writer process needs: the revision's database and cache, the counter."""

    store: str
    """SQLAlchemy URL of the revision's database, password included."""
    cache: str
    name: str
    interval: float = 1.0
    report_dir: str = ""
    """Where an ids writer leaves the ids it was handed."""


@contextlib.contextmanager
def sharded_writer(target: Target) -> Iterator[Op]:
    """``incr()`` of the sharded counter; ``value()`` warms both connections first."""
    with shardkit.connect(target.store, target.cache, prefix=PREFIX) as kit:
        counter = kit.sharded(target.name, shards=SHARDS)
        counter.value()
        yield counter.incr


@contextlib.contextmanager
def buffered_writer(target: Target) -> Iterator[Op]:
    """``incr()`` of the buffered counter; ``parts()`` warms both connections and
    schedules no flush. The kit's close runs the flush it has waiting."""
    with shardkit.connect(target.store, target.cache, prefix=PREFIX) as kit:
        counter = kit.buffered(target.name, interval=target.interval)
        counter.parts()
        yield counter.incr


@contextlib.contextmanager
def ids_writer(target: Target) -> Iterator[Op]:
    """``next()`` of the id allocator, recording the ids handed out (``Tally``)."""
    with shardkit.connect(target.store, target.cache, prefix=PREFIX) as kit:
        tally = Tally(kit.ids(target.name).next)
        yield tally.op
    tally.close()
    tally.report(Path(target.report_dir))


def setup_django(target: Target) -> None:
    """Configure Django once per process: ``compare_app`` and shardkit's app on the
    revision's database (persistent connections, as a deployed site has them)."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    url = sa.make_url(target.store)
    settings.configure(
        INSTALLED_APPS=["shardkit.contrib.django", "compare_app"],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": url.database,
                "USER": url.username or "postgres",
                "PASSWORD": url.password or "",
                "HOST": url.host or "127.0.0.1",
                "PORT": url.port or 5432,
                "CONN_MAX_AGE": None,
            }
        },
        SHARDKIT={"CACHE": target.cache},
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    )
    django.setup()


def django_objects(target: Target) -> tuple[Any, Any]:
    """The model, and the primary keys of its two objects: one to warm up on, one hot."""
    setup_django(target)
    from compare_app.models import Hit

    warm, hot = Hit.objects.order_by("pk").values_list("pk", flat=True)[:2]
    return Hit, (warm, hot)


@contextlib.contextmanager
def django_writer(target: Target) -> Iterator[Op]:
    """The counting update of the hot object, warmed up on the other one."""
    from django.db.models import F

    model, (warm, hot) = django_objects(target)
    model.objects.filter(pk=warm).update(views=F("views") + 1)
    yield lambda: model.objects.filter(pk=hot).update(views=F("views") + 1)


@contextlib.contextmanager
def idle(_: None) -> Iterator[Op]:
    """Nothing to write: a phase of it waits until every writer process is up."""
    yield lambda: None


def add_one(batch: Any) -> None:
    """The mapping job's ``fn``: one ``UPDATE`` of the page's rows in its transaction."""
    ids = [record[0] for record in batch.records]
    batch.conn.execute(
        sa.text(f"UPDATE {TABLE} SET balance = balance + 1 WHERE id = ANY(:ids)"), {"ids": ids}
    )


@dataclass
class Counted:
    """A path of writer processes whose counter must move by their acknowledged writes."""

    setup: Setup[Target]
    target: Target
    read: Callable[[], int]

    def run(self, crew: Crew, seconds: float) -> Outcome:
        before = self.read()
        phase = crew.run(self.setup, self.target, seconds)
        moved = self.read() - before
        return outcome(phase, moved == phase.ops, f"moved {moved:,} for {phase.ops:,} acknowledged")


@dataclass
class Ids:
    """The id allocator's path: every id handed out once, each counted, none above what
    the store reserved, each writer's increasing (across all rounds)."""

    target: Target
    reserved: Callable[[], int]
    reports: Reports

    def run(self, crew: Crew, seconds: float) -> Outcome:
        faults = self.reports.doubled + self.reports.backwards
        phase = crew.run(ids_writer, self.target, seconds)
        mark = self.reserved()
        taken, largest = self.reports.collect(Path(self.target.report_dir))
        new_faults = self.reports.doubled + self.reports.backwards - faults
        exact = new_faults == 0 and taken == phase.ops and largest <= mark
        detail = (
            f"{taken:,} ids for {phase.ops:,} acknowledged, {new_faults} twice or backwards, "
            f"largest {largest:,} of {mark:,} reserved"
        )
        return outcome(phase, exact, detail)


@dataclass
class MapPath:
    """One transactional mapping job over the table, in this process: rows per second of
    wall time, this process's CPU per row, every row visited exactly once."""

    kit: Any
    engine: sa.Engine
    table: sa.Table
    rows: int
    jobs: int = 0

    def run(self) -> Outcome:
        began, cpu = time.monotonic(), time.process_time()
        self.kit.map(self.table, add_one, transactional=True).wait(timeout=JOB_TIMEOUT)
        elapsed, spent = time.monotonic() - began, time.process_time() - cpu
        self.jobs += 1
        self.kit.purge_jobs(age=0)  # the ledger stays as small as in the first round
        with self.engine.connect() as conn:
            wrong, total = conn.execute(
                sa.text(f"SELECT count(*) FILTER (WHERE balance <> :n), count(*) FROM {TABLE}"),
                {"n": self.jobs},
            ).one()
        phase = Phase(counts=(self.rows,), elapsed=(elapsed,), cpu=(spent,))
        exact = wrong == 0 and total == self.rows
        return outcome(phase, exact, f"{wrong:,} of {total:,} rows not visited exactly once")


def outcome(phase: Phase, exact: bool, detail: str) -> Outcome:
    return {
        "rate": phase.rate,
        "ops": phase.ops,
        "cpu_per_op": phase.cpu_per_op,
        "exact": exact,
        "detail": detail,
    }


class Revision:
    """This revision's paths on its database and cache, and the crew that writes."""

    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        self.args = args
        self.stack = stack
        self.kit = stack.enter_context(shardkit.connect(args.store, args.cache, prefix=PREFIX))
        self.namespaces = [self.kit.namespace]
        self.paths: dict[str, Counted | Ids | MapPath] = {}
        self.crew: Crew | None = None
        self.scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cmp-ids-")))

    def target(self, name: str, **more: Any) -> Target:
        return Target(self.args.store, self.args.cache, name, **more)

    def prepare(self, path: str) -> Counted | Ids | MapPath:
        if path == "sharded":
            sharded = self.kit.sharded("hot-sharded", shards=SHARDS)
            return Counted(
                sharded_writer, self.target(sharded.name), lambda: sharded.value(fresh=True)
            )
        if path == "buffered":
            buffered = self.kit.buffered("hot-buffered", interval=self.args.interval)

            def stored() -> int:
                buffered.flush()  # what the writers' kits left pending in the cache
                return int(buffered.parts().stored)

            target = self.target(buffered.name, interval=self.args.interval)
            return Counted(buffered_writer, target, stored)
        if path == "ids":
            ids = self.kit.ids("hot-ids")
            return Ids(self.target(ids.name, report_dir=str(self.scratch)), ids.reserved, Reports())
        if path == "django":
            return self.prepare_django()
        return self.prepare_map()

    def prepare_django(self) -> Counted:
        target = self.target("django")
        setup_django(target)
        from django.core.management import call_command

        from shardkit.contrib.django import kit

        call_command("migrate", run_syncdb=True, verbosity=0)
        from compare_app.models import Hit

        for _ in range(2):
            Hit.objects.create()
        self.namespaces.append(kit().namespace)
        model, (_, hot) = django_objects(target)
        return Counted(
            django_writer, target, lambda: int(model.objects.get(pk=hot).views.value(fresh=True))
        )

    def prepare_map(self) -> MapPath:
        engine = sa.create_engine(self.args.store)
        self.stack.callback(engine.dispose)
        table = sa.Table(
            TABLE,
            sa.MetaData(),
            sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("balance", sa.BigInteger, nullable=False),
        )
        with engine.begin() as conn:
            table.create(conn)
            conn.execute(
                sa.text(f"INSERT INTO {TABLE} SELECT g, 0 FROM generate_series(1, :n) g"),
                {"n": self.args.rows},
            )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text(f"VACUUM ANALYZE {TABLE}"))  # the statistics kit.map plans by
        return MapPath(self.kit, engine, table, self.args.rows)

    def start_crew(self) -> None:
        """Start the writer processes if a path needs them and none are running, and wait
        until every one has started (``compare.py`` has both revisions' start at once,
        and none still starting when the first round runs)."""
        if self.crew is None and any(not isinstance(p, MapPath) for p in self.paths.values()):
            self.crew = Crew(self.args.writers)
            self.crew.run(idle, None, 0.0, ready=STARTING)

    def run(self, path: str, seconds: float) -> Outcome:
        runner = self.paths[path]
        if isinstance(runner, MapPath):
            return runner.run()
        self.start_crew()
        assert self.crew is not None
        try:
            return runner.run(self.crew, seconds)
        except RuntimeError:
            self.crew.close()  # broken: the next round starts a new one
            self.crew = None
            raise

    def close(self) -> None:
        if self.crew is not None:
            self.crew.close()
        if "django" in self.paths:
            from shardkit.contrib.django import kit

            kit().close()
        import redis

        client = redis.Redis.from_url(self.args.cache)
        for namespace in self.namespaces:
            forget_redis_keys(client, namespace)
        client.close()


def serve(revision: Revision, commands: TextIO, answers: TextIO) -> None:
    """Answer each command of ``commands`` on ``answers`` until ``close``."""
    for line in commands:
        command = json.loads(line)
        answer: dict[str, Any]
        if command["op"] == "close":
            return
        try:
            if command["op"] == "prepare":
                answer = {"version": shardkit.__version__, "file": shardkit.__file__, "paths": {}}
                for path in command["paths"]:
                    answer["paths"][path] = ready(revision, path)
                revision.start_crew()
            else:
                answer = revision.run(command["path"], float(command["seconds"]))
        except Exception as exc:
            traceback.print_exc()
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def ready(revision: Revision, path: str) -> str | None:
    """Prepare ``path``: None once it is ready, or why it cannot run here: ``missing: …``
    when this revision lacks an API the path uses, ``failed: …`` otherwise."""
    try:
        revision.paths[path] = revision.prepare(path)
    except Exception as exc:
        traceback.print_exc()
        why = "missing" if isinstance(exc, MISSING) else "failed"
        return f"{why}: {type(exc).__name__}: {exc}"
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="SQLAlchemy URL of the database")
    parser.add_argument("--cache", required=True, help="Redis URL")
    parser.add_argument("--writers", type=int, default=16, help="writer processes (16)")
    parser.add_argument("--interval", type=float, default=1.0, help="buffered flush interval")
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the mapped table")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints (writers' too) to stderr
    with contextlib.ExitStack() as stack:
        revision = Revision(args, stack)
        try:
            serve(revision, sys.stdin, answers)
        finally:
            revision.close()
    answers.write(json.dumps({"closed": True}) + "\n")
    answers.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
