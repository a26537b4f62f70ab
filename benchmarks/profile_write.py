"""Client CPU per write of one writer process, by mode and by function.

One process, one writing thread, writes of several modes taken in turns (``--rounds`` of
``--batch`` writes each, after a warm-up), so that every mode meets the same load of a
shared machine and their ratios hold where absolute figures drift:

* sharded, sharded+metrics - ``kit.sharded(name, shards=N).incr()``, metrics off / on
* auto     - the same counter opened ``shards="auto"`` once made with N shards: an
             automatic counter that has grown (revisions that have automatic shards)
* buffered, buffered+metrics - ``kit.buffered(name, interval=1.0).incr()``
* upsert   - raw psycopg ``INSERT … ON CONFLICT DO UPDATE`` on a random one of N rows,
             autocommit, psycopg's preparing left as is (hot_counter.py's ``upsert``)
* incr     - raw redis-py ``INCR`` on one key (hot_counter.py's ``redis-incr``)

For each mode it prints the writing thread's CPU per write (``time.thread_time()``) and
the process's (``time.process_time()``: the kit's background threads too, which may also
run in another mode's turn), medians over the rounds, and the writing thread's ratio to
``upsert`` (sharded modes) or ``incr`` (buffered). With ``--profile`` it runs the first
mode alone under cProfile, timing the writing thread's CPU, and lists its ``--top``
functions by own time in µs per write and the function calls per write. It uses only
the API every revision has (``shardkit.connect``, ``kit.sharded``, ``kit.buffered``,
``shardkit.metrics.enable``/``disable``), so it runs against whichever shardkit the
interpreter imports.

    python benchmarks/profile_write.py sharded,upsert,buffered,incr \\
        --store postgresql://postgres@127.0.0.1:5432/test --cache redis://127.0.0.1:6379/13
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa

MODES = ("sharded", "sharded+metrics", "auto", "buffered", "buffered+metrics", "upsert", "incr")
Write = Callable[[], object]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", help=f"comma-separated, of {','.join(MODES)}")
    parser.add_argument("--store", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--cache", default="redis://127.0.0.1:6379/13")
    parser.add_argument("--shards", type=int, default=32, help="shards and raw rows (32)")
    parser.add_argument("--batch", type=int, default=500, help="writes per turn (500)")
    parser.add_argument("--rounds", type=int, default=20, help="turns of each mode (20)")
    parser.add_argument("--warmup", type=int, default=1000, help="writes before timing (1000)")
    parser.add_argument("--profile", action="store_true", help="the first mode under cProfile")
    parser.add_argument("--top", type=int, default=30, help="functions listed (30)")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    if unknown := set(args.modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}")
    return args


@contextlib.contextmanager
def writers(args: argparse.Namespace) -> Iterator[dict[str, Write]]:
    """Each mode's write, set up (one kit for all of shardkit's) and torn down."""
    tag = uuid.uuid4().hex[:8]
    with contextlib.ExitStack() as stack:
        made: dict[str, Write] = {}
        if "upsert" in args.modes:
            made["upsert"] = stack.enter_context(upsert(args.store, tag, args.shards))
        if "incr" in args.modes:
            made["incr"] = stack.enter_context(redis_incr(args.cache, tag))
        if kit_modes := [m for m in args.modes if m not in made]:
            made.update(stack.enter_context(kit_writes(args, tag, kit_modes)))
        yield made


@contextlib.contextmanager
def kit_writes(args: argparse.Namespace, tag: str, modes: list[str]) -> Iterator[dict[str, Write]]:
    os.environ["SHARDKIT_METRICS"] = "off"  # turned on and off per turn (``metered``)
    import shardkit

    prefix, name = f"skprof{tag}_", f"hot{tag}"
    try:
        with shardkit.connect(args.store, args.cache, prefix=prefix) as kit:
            made: dict[str, Write] = {}
            for mode in modes:
                if mode.startswith("buffered"):
                    made[mode] = kit.buffered(f"{name}b", interval=1.0).incr
                elif mode == "auto":
                    kit.sharded(f"{name}a", shards=args.shards)
                    counter: Any = kit.sharded(f"{name}a", shards="auto")
                    made[mode] = counter.incr
                else:
                    made[mode] = kit.sharded(name, shards=args.shards).incr
            yield made
            forget_keys(args.cache, name)
    finally:
        drop_tables(args.store, prefix)


@contextlib.contextmanager
def upsert(url: str, tag: str, shards: int) -> Iterator[Write]:
    import psycopg

    table = f"skraw{tag}"
    sql = (
        f"INSERT INTO {table} (name, shard, value) VALUES (%s, %s, %s) "
        f"ON CONFLICT (name, shard) DO UPDATE SET value = {table}.value + excluded.value"
    )
    parsed = sa.make_url(url)
    with psycopg.connect(
        host=parsed.host, port=parsed.port, user=parsed.username, dbname=parsed.database
    ) as conn:
        conn.autocommit = True
        conn.execute(
            f"CREATE TABLE {table} (name VARCHAR(200), shard INTEGER, value BIGINT, "
            "PRIMARY KEY (name, shard))"
        )
        try:
            cursor, pick = conn.cursor(), random.randrange
            yield lambda: cursor.execute(sql, ("hot", pick(shards), 1))
        finally:
            conn.execute(f"DROP TABLE {table}")


@contextlib.contextmanager
def redis_incr(url: str, tag: str) -> Iterator[Write]:
    import redis

    client = redis.Redis.from_url(url)
    key, incr = f"skprof{tag}", client.incr
    try:
        yield lambda: incr(key)
    finally:
        client.delete(key)
        client.close()


def drop_tables(url: str, prefix: str) -> None:
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        md = sa.MetaData()
        md.reflect(engine, only=lambda table, _: table.startswith(prefix))
        md.drop_all(engine)
    finally:
        engine.dispose()


def forget_keys(url: str, name: str) -> None:
    """Delete the keys naming this run's counters (the sharded value, ticket, writers;
    the buffered sums and pointers), on the caller's own Redis database."""
    import redis

    if url.startswith(("redis://", "rediss://", "unix://")):
        client = redis.Redis.from_url(url)
        for key in client.scan_iter(match=f"*{name}*", count=1000):
            client.delete(key)
        client.close()


def metered(mode: str) -> None:
    """Metrics on for a ``+metrics`` mode's turn, off for another of shardkit's."""
    if mode in ("upsert", "incr"):
        return
    from shardkit import metrics

    if mode.endswith("+metrics"):
        metrics.enable()
    else:
        metrics.disable()


def turn(write: Write, writes: int) -> tuple[float, float]:
    """CPU seconds of the writing thread, and of the process, per write."""
    thread, process = time.thread_time(), time.process_time()
    for _ in range(writes):
        write()
    return (time.thread_time() - thread) / writes, (time.process_time() - process) / writes


def profiled(write: Write, writes: int, top: int) -> None:
    profile = cProfile.Profile(time.thread_time)  # the writing thread's CPU, no waits
    profile.enable()
    for _ in range(writes):
        write()
    profile.disable()
    rows: dict[Any, Any] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    ranked = sorted(rows.items(), key=lambda item: -item[1][2])
    own = sum(row[2] for row in rows.values()) / writes * 1e6
    calls = sum(row[1] for row in rows.values()) / writes
    print(f"{own:.1f} CPU µs/write (profiler included), {calls:.1f} calls/write, {writes} writes")
    print(f"{'own µs':>8} {'cum µs':>8} {'calls/w':>8}  function")
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in ranked[:top]:
        where = path.split("site-packages/")[-1].split("/src/")[-1]
        print(
            f"{tottime / writes * 1e6:8.2f} {cumtime / writes * 1e6:8.2f} "
            f"{ncalls / writes:8.2f}  {where}:{line}({func})"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with writers(args) as made:
        for mode in args.modes:
            metered(mode)
            turn(made[mode], args.warmup)
        if args.profile:
            mode = args.modes[0]
            metered(mode)
            profiled(made[mode], args.batch * args.rounds, args.top)
            return 0
        taken: dict[str, list[tuple[float, float]]] = {mode: [] for mode in args.modes}
        for _ in range(args.rounds):
            for mode in args.modes:
                metered(mode)
                taken[mode].append(turn(made[mode], args.batch))
    load = os.getloadavg()
    print(f"{args.rounds} turns of {args.batch} writes; load average {load[0]:.2f}")
    thread = {m: statistics.median(t for t, _ in runs) for m, runs in taken.items()}
    print(f"{'mode':<17} {'thread µs':>9} {'process µs':>10} {'vs raw':>7}")
    for mode, runs in taken.items():
        raw = "incr" if mode.startswith("buffered") else "upsert"
        shardkits = mode not in ("upsert", "incr")
        versus = f"{thread[mode] / thread[raw]:.3f}" if shardkits and raw in thread else ""
        process = statistics.median(p for _, p in runs)
        print(f"{mode:<17} {thread[mode] * 1e6:9.1f} {process * 1e6:10.1f} {versus:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
