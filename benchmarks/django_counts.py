"""One hot count updated through the Django ORM by many writer processes, side by side.

* column   - ``Account.objects.filter(pk=pk).update(balance=F("balance") + 1)``: a real
             column of one row, the way a Django counter is written without shardkit
* sharded  - ``Video.objects.filter(pk=pk).update(views=F("views") + 1)``: the same line
             on a ``ShardedCount(shards=20)``
* incr     - ``video.views.incr()``: the sharded count without the update
* buffered - ``Video.objects.filter(pk=pk).update(likes=F("likes") + 1)`` on a buffered
             count (only with a Redis ``--cache``, which the writer processes share)

With ``--request-ms T`` each update runs as a request with ``ATOMIC_REQUESTS`` would:
inside ``transaction.atomic()``, followed by T ms of the request's other work before the
commit. The row lock of a column's update is then held for the whole request, and every
writer queues on it; a sharded count's writers each hold their own shard row.

The models are the example site's (``examples/django_site``); every writer process sets
Django up on ``--database``, a PostgreSQL database of the benchmark's own (created if
missing, migrated), with persistent connections (``CONN_MAX_AGE=None``) as a deployed
site would have. Every cell is checked: the count moved by exactly the acknowledged
updates (the buffered one once flushed after the phase).

    python benchmarks/django_counts.py --cache redis://127.0.0.1:6379/12 --repeat 3
    python benchmarks/django_counts.py --cache redis://127.0.0.1:6379/12 --request-ms 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import sqlalchemy as sa
from rich.table import Table

from harness import Crew, Op, Phase, median_phase, ratio, run_grid
from hot_counter import REDIS_SCHEMES, choose_modes, report_console

SITE = Path(__file__).resolve().parent.parent / "examples" / "django_site"
DEFAULT_DATABASE = "postgresql://postgres@127.0.0.1:5432/shardkit_bench_django"
MODES = ("column", "sharded", "incr", "buffered")
BASELINE = "column"


@dataclass(frozen=True)
class Site:
    """What a writer process needs to set Django up like the parent did."""

    database: str
    cache: str
    request_ms: float = 0.0


def setup_django(site: Site) -> None:
    """Configure Django for the example site's apps on ``site``, once per process."""
    from django.conf import settings

    if settings.configured:
        return
    if str(SITE) not in sys.path:
        sys.path.insert(0, str(SITE))
    url = urlsplit(site.database)
    import django

    settings.configure(
        INSTALLED_APPS=["shardkit.contrib.django", "videos"],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": url.path.lstrip("/"),
                "USER": url.username or "postgres",
                "PASSWORD": url.password or "",
                "HOST": url.hostname or "127.0.0.1",
                "PORT": url.port or 5432,
                "CONN_MAX_AGE": None,
            }
        },
        SHARDKIT={"CACHE": site.cache},
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    )
    django.setup()


@contextlib.contextmanager
def writer(task: tuple[Site, str]) -> Iterator[Op]:
    """A writer process's update for ``mode``, warmed up on another object so that no
    total moves before the phase."""
    site, mode = task
    setup_django(site)
    from django.db import transaction
    from django.db.models import F

    from videos.models import Account, Video

    warm_video, video = Video.objects.order_by("pk")[:2]
    warm_account, account = Account.objects.order_by("pk")[:2]
    updates: dict[str, Any] = {
        "column": lambda pk: Account.objects.filter(pk=pk).update(balance=F("balance") + 1),
        "sharded": lambda pk: Video.objects.filter(pk=pk).update(views=F("views") + 1),
        "incr": lambda pk: Video.objects.get(pk=pk).views.incr(),
        "buffered": lambda pk: Video.objects.filter(pk=pk).update(likes=F("likes") + 1),
    }
    update = updates[mode]
    update(warm_account.pk if mode == "column" else warm_video.pk)
    if mode == "incr":
        count = video.views  # the object is at hand: no read per increment
        write = count.incr
    else:
        target = account.pk if mode == "column" else video.pk

        def write() -> None:
            update(target)

    if not site.request_ms:
        yield write
        return

    def request() -> None:
        with transaction.atomic():
            write()
            time.sleep(site.request_ms / 1000)  # the rest of the request

    yield request


def total(mode: str) -> int:
    """The measured object's count as the store has it now (flushed first if buffered)."""
    from shardkit.contrib.django import kit
    from videos.models import Account, Video

    if mode == "column":
        return int(Account.objects.order_by("pk")[1].balance)
    video = Video.objects.order_by("pk")[1]
    if mode == "buffered":
        kit().flush_all()
        return video.likes.counter.parts().stored
    return video.views.value(fresh=True)


@dataclass
class Cell:
    phases: list[Phase] = field(default_factory=list)
    exact: bool = True

    @property
    def rate(self) -> float:
        return median_phase(self.phases)


def create_database(database: str) -> None:
    """Create the PostgreSQL database that the URL ``database`` names, if missing."""
    url = urlsplit(database)
    server = sa.create_engine(
        f"postgresql+psycopg://{url.netloc}/postgres", isolation_level="AUTOCOMMIT"
    )
    with server.connect() as conn:
        name = url.path.lstrip("/")
        found = conn.execute(
            sa.text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
        ).first()
        if found is None:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    server.dispose()


def prepare(site: Site) -> None:
    """Create the database if missing, migrate it, and make two videos and accounts."""
    create_database(site.database)
    setup_django(site)
    from django.core.management import call_command

    from videos.models import Account, Video

    call_command("migrate", verbosity=0)
    for i in range(2 - Video.objects.count()):
        Video.objects.create(title=f"bench {i}")
    for i in range(2 - Account.objects.count()):
        Account.objects.create(email=f"bench{i}@example.com")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", default=DEFAULT_DATABASE, help="PostgreSQL URL")
    parser.add_argument("--cache", default="memory://", help="cache URL (memory://)")
    parser.add_argument("--writers", default="1,16", help="writer counts (1,16)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per phase (3)")
    parser.add_argument("--repeat", type=int, default=3, help="median of N phases (3)")
    parser.add_argument(
        "--request-ms",
        type=float,
        default=0.0,
        help="ms of a request's other work after the update, in its transaction (0)",
    )
    parser.add_argument("--modes", help=f"comma-separated, of {','.join(MODES)}")
    args = parser.parse_args(argv)
    args.writers = [int(n) for n in args.writers.split(",")]
    shared = args.cache.split(":", 1)[0] in REDIS_SCHEMES
    default = [mode for mode in MODES if mode != "buffered" or shared]
    args.modes = choose_modes(parser, args.modes, MODES, default)
    if "buffered" in args.modes and not shared:
        parser.error("the buffered mode needs a Redis --cache that the writers share")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console()
    site = Site(args.database, args.cache, args.request_ms)
    prepare(site)
    cells: dict[tuple[int, str], Cell] = {}

    def run(crew: Crew, writers: int, mode: str) -> None:
        before = total(mode)
        phase = crew.run(writer, (site, mode), args.seconds)
        cell = cells.setdefault((writers, mode), Cell())
        cell.phases.append(phase)
        cell.exact = cell.exact and total(mode) - before == phase.ops

    console.print(
        f"database {sa.make_url(args.database).render_as_string()}, cache {args.cache}, "
        f"{args.request_ms:g} ms of request after each update, "
        f"load average {' '.join(f'{n:.1f}' for n in os.getloadavg())}"
    )
    run_grid(args.writers, args.repeat, args.modes, run, console)
    table = Table(title="One hot count updated through the Django ORM (updates/s, medians)")
    for column in ("writers", "mode", "updates/s", f"vs {BASELINE}", "checked"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for (writers, mode), cell in cells.items():
        table.add_row(
            str(writers),
            mode,
            f"{cell.rate:,.0f}",
            ratio(cells, writers, mode, BASELINE),
            "[green]✓[/]" if cell.exact else "[red]✗[/]",
        )
    console.print(table)
    return 0 if all(cell.exact for cell in cells.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
