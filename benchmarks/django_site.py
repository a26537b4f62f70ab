"""The example Django site under gunicorn, loaded over HTTP by wrk: one hot object's count
moved per request, side by side, without and with ``ATOMIC_REQUESTS``.

* column   - ``Account.objects.filter(pk=pk).update(balance=F("balance") + 1)``: a plain
             column of one row, as a Django counter is written without shardkit
* sharded  - ``Video.objects.filter(pk=pk).update(views=F("views") + 1)`` on a
             ``ShardedCount`` (its shards automatic)
* buffered - ``Video.objects.filter(pk=pk).update(likes=F("likes") + 1)`` on a buffered
             ``ShardedCount``
* likes-incr - ``Video(pk=pk).likes.incr()``: the buffered count without ``update()``'s
             read of whether the object exists (its key trusted, as from a signed token)
* upsert   - the sharded count's one statement written by hand: an ``INSERT … ON CONFLICT
             DO UPDATE`` of a row per thread, raw SQL on Django's connection, the ceiling
             of ``sharded`` (what one statement per request costs, with no library)
* orm-upsert - the queryset and expression of the ``sharded`` line built, as Django
             builds them before any count's code runs, then the same upsert: the ceiling
             of a count updated through ``update()``
* orm-incr - the same of the ``buffered`` line, then the trusted-key ``incr()``
* noop     - a view that does nothing: the framework's (and this machine's) ceiling

The site (``examples/django_site``, its endpoints in ``benchmarks/site_bench``) runs
under gunicorn (``--workers`` x ``--threads``, gthread) on a PostgreSQL database of the
benchmark's own (created if missing, migrated) with persistent connections, and shardkit
on a Redis cache. wrk (Debian's package) loads each endpoint with ``--connections`` for
``--seconds``; every cell is checked: the count moved by the completed responses, plus
at most those in flight when this run and the one before stopped (one per connection
each), with no error.

    pip install -e '.[test,bench]' && apt-get install wrk
    python benchmarks/django_site.py --cache redis://127.0.0.1:6379/12 --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from rich.table import Table

from django_counts import create_database
from hot_counter import choose_modes, report_console
from http_load import Cell, free_port, serving, wrk

HERE = Path(__file__).resolve().parent
SITE = HERE.parent / "examples" / "django_site"
DEFAULT_DATABASE = "postgresql://postgres@127.0.0.1:5432/shardkit_bench_site"
MODES = ("column", "sharded", "buffered", "likes-incr", "upsert", "orm-upsert", "orm-incr", "noop")
BASELINE = "column"
# Each count's form written by hand (the upsert on Django's cursor; the trusted-key
# incr()), and the least ratio to it, without and with ATOMIC_REQUESTS.
BY_HAND = {"sharded": "upsert", "buffered": "likes-incr"}
# The same after the ORM work of the count's line (its queryset and expression built):
# what any count behind ``update()`` could reach.
AFTER_ORM = {"upsert": "orm-upsert", "likes-incr": "orm-incr"}
TARGET = 0.9


def environment(database: str, cache: str, atomic: bool) -> dict[str, str]:
    """The site's environment: its settings module and what it reads."""
    # The site first: its package ``django_site`` is not this script.
    paths = [str(SITE), str(HERE), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "site_bench.settings",
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "SHARDKIT_BENCH_DATABASE": database,
        "SHARDKIT_BENCH_CACHE": cache,
        "SHARDKIT_BENCH_ATOMIC": "1" if atomic else "0",
    }


def prepare(database: str, cache: str) -> tuple[int, int]:
    """Create the database if missing, migrate it, and return a video's and an account's
    keys (made if missing)."""
    create_database(database)
    os.environ.update(environment(database, cache, atomic=False))
    sys.path[:0] = [str(SITE), str(HERE)]
    import django

    django.setup()
    from django.core.management import call_command

    from videos.models import Account, Video

    call_command("migrate", verbosity=0)
    from django.db import connection

    from site_bench.urls import HITS

    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE IF NOT EXISTS {HITS} (slot text PRIMARY KEY, n bigint)")
    video = Video.objects.order_by("pk").first() or Video.objects.create(title="bench")
    account = Account.objects.order_by("pk").first() or Account.objects.create(
        email="bench@example.com"
    )
    return video.pk, account.pk


def count_of(mode: str, video: int, account: int) -> int:
    """The hot object's count of ``mode`` now (a buffered count's stored plus pending)."""
    from videos.models import Account, Video

    if mode == "column":
        return int(Account.objects.get(pk=account).balance)
    if mode == "sharded":
        return Video.objects.get(pk=video).views.value(fresh=True)
    if mode in ("buffered", "likes-incr", "orm-incr"):
        return Video.objects.get(pk=video).likes.value()
    if mode in ("upsert", "orm-upsert"):
        from django.db import connection

        from site_bench.urls import HITS

        with connection.cursor() as cursor:
            cursor.execute(f"SELECT coalesce(sum(n), 0) FROM {HITS}")
            return int(cursor.fetchone()[0])
    return 0


@contextlib.contextmanager
def gunicorn(env: dict[str, str], workers: int, threads: int) -> Iterator[str]:
    """The site under gunicorn; yields its base URL once it answers."""
    port = free_port()
    command = [
        sys.executable, "-m", "gunicorn", "site_bench.wsgi",
        "--bind", f"127.0.0.1:{port}", "--workers", str(workers), "--threads", str(threads),
        "--worker-class", "gthread", "--log-level", "warning",
    ]  # fmt: skip
    with serving(command, env, port, "/noop") as base:
        yield base


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", default=DEFAULT_DATABASE, help="PostgreSQL URL")
    parser.add_argument("--cache", default="redis://127.0.0.1:6379/12", help="cache URL")
    parser.add_argument("--workers", type=int, default=4, help="gunicorn workers (4)")
    parser.add_argument("--threads", type=int, default=4, help="threads per worker (4)")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections (16)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per run (5)")
    parser.add_argument("--repeat", type=int, default=3, help="median of N runs (3)")
    parser.add_argument("--modes", help=f"comma-separated, of {','.join(MODES)}")
    parser.add_argument(
        "--atomic",
        choices=("both", "off", "on"),
        default="both",
        help="ATOMIC_REQUESTS: run without it, with it, or both (both)",
    )
    args = parser.parse_args(argv)
    args.modes = choose_modes(parser, args.modes, MODES, list(MODES))
    if min(args.workers, args.threads, args.connections, args.repeat) < 1:
        parser.error("--workers, --threads, --connections and --repeat must be >= 1")
    if shutil.which("wrk") is None:
        parser.error("wrk is missing: apt-get install wrk")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console()
    video, account = prepare(args.database, args.cache)
    atomics = {"both": [False, True], "off": [False], "on": [True]}[args.atomic]
    paths = {"column": f"/column/{account}", "sharded": f"/sharded/{video}"}
    paths |= {"buffered": f"/buffered/{video}", "likes-incr": f"/likes-incr/{video}"}
    paths |= {"upsert": f"/upsert/{video}", "orm-upsert": f"/orm-upsert/{video}"}
    paths |= {"orm-incr": f"/orm-incr/{video}"}
    paths |= {"noop": "/noop"}
    cells: dict[tuple[bool, str], Cell] = {}
    console.print(
        f"gunicorn {args.workers} x {args.threads} (gthread), wrk {args.connections} "
        f"connections, {args.seconds:g} s per run, {args.repeat} run(s); database "
        f"{sa.make_url(args.database).render_as_string()}, cache {args.cache}; load average "
        f"{' '.join(f'{n:.1f}' for n in os.getloadavg())}"
    )
    for atomic in atomics:
        env = environment(args.database, args.cache, atomic)
        with gunicorn(env, args.workers, args.threads) as base:
            for mode in args.modes:  # warm every worker's connections and counters
                wrk(base + paths[mode], args.connections, 1)
            for number in range(args.repeat):
                turn = number % len(args.modes)  # each repetition starts one mode further on
                for mode in args.modes[turn:] + args.modes[:turn]:
                    label = f"ATOMIC_REQUESTS={atomic}, {mode}, run {number + 1}…"
                    with console.status(label):
                        before = count_of(mode, video, account)
                        load = wrk(base + paths[mode], args.connections, args.seconds)
                        moved = count_of(mode, video, account) - before
                    cell = cells.setdefault((atomic, mode), Cell())
                    cell.rates.append(load.rate)
                    # Requests in flight when a wrk run stops are served after it: counted
                    # in this run (at most one per connection) or, from the run before,
                    # after ``before`` was read (as many more).
                    surplus = moved - load.completed
                    checked = mode == "noop" or 0 <= surplus <= 2 * args.connections
                    if load.failed or not checked:
                        cell.exact = False
                        cell.notes.append(f"{load.completed} done, {moved} counted, "
                                          f"{load.failed} failed")  # fmt: skip
    console.print(results_table(cells, atomics, args.modes))
    for atomic in atomics:
        console.print(targets_line(cells, atomic, args.modes))
    for (atomic, mode), cell in cells.items():
        for note in cell.notes:
            console.print(f"[red]ATOMIC_REQUESTS={atomic} {mode}: {note}[/]")
    return 0 if all(cell.exact for cell in cells.values()) else 1


def results_table(
    cells: dict[tuple[bool, str], Cell], atomics: list[bool], modes: list[str]
) -> Table:
    table = Table(title="One hot object's count per request, over HTTP (requests/s, medians)")
    for column in (
        "ATOMIC_REQUESTS",
        "endpoint",
        "requests/s",
        f"vs {BASELINE}",
        "vs by hand",
        "checked",
        "runs",
    ):
        table.add_column(column, justify="left" if column in ("endpoint", "runs") else "right")
    for atomic in atomics:
        for mode in modes:
            cell = cells[atomic, mode]
            table.add_row(
                "on" if atomic else "off",
                mode,
                f"{cell.rate:,.0f}",
                ratio(cells, atomic, mode, BASELINE),
                ratio(cells, atomic, mode, BY_HAND.get(mode)),
                "[green]✓[/]" if cell.exact else "[red]✗[/]",
                " ".join(f"{rate:,.0f}" for rate in cell.rates),
                end_section=mode == modes[-1],
            )
    return table


def ratio(cells: dict[tuple[bool, str], Cell], atomic: bool, mode: str, to: str | None) -> str:
    """``mode``'s rate over ``to``'s, or "-" when either was not run."""
    if to is None or (atomic, to) not in cells or mode == to:
        return "-"
    return f"{cells[atomic, mode].rate / cells[atomic, to].rate:.2f}x"


def targets_line(cells: dict[tuple[bool, str], Cell], atomic: bool, modes: list[str]) -> str:
    """Each count against its hand-written form (target ``TARGET``)."""
    parts = []
    for mode, hand in BY_HAND.items():
        if mode in modes and hand in modes:
            got = cells[atomic, mode].rate / cells[atomic, hand].rate
            mark = "[green]✓[/]" if got >= TARGET else "[red]✗[/]"
            # Each round's ratio: the two ran in the same round, minutes apart at most.
            rounds = [
                rate / by_hand
                for rate, by_hand in zip(
                    cells[atomic, mode].rates, cells[atomic, hand].rates, strict=True
                )
            ]
            parts.append(
                f"{mode} ÷ {hand} {got:.2f}x (target ≥ {TARGET:g}x) {mark}, each round's "
                f"{' '.join(f'{r:.2f}' for r in rounds)} (median {statistics.median(rounds):.2f}x)"
            )
            after = AFTER_ORM[hand]
            if after in modes:
                cap = cells[atomic, after].rate / cells[atomic, hand].rate
                parts.append(f"its line's ORM work alone: {after} ÷ {hand} {cap:.2f}x")
    if "noop" in modes and BASELINE in modes:
        ceiling = cells[atomic, "noop"].rate / cells[atomic, BASELINE].rate
        parts.append(f"ceiling (noop ÷ {BASELINE}) {ceiling:.2f}x")
    return f"ATOMIC_REQUESTS {'on' if atomic else 'off'}: " + "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
