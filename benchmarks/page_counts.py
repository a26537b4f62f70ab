"""A page of objects with their counts (``with_counts``), most of them cold: counters
created with 20 shards each (the old default) against automatic shards, side by side.

The page is ``--objects`` (50) of the example site's videos per mode: ``--hot`` (5) of
them took ``--hot-views`` (2,000) views each, the others a few (1 … 40, the same numbers
in both modes), written by ``--threads`` (32) threads through the counting update, each
thread a writer with its own shard (its ticket), as a site's request threads are.

* fixed20 - ``ShardedCount(shards=20)``: every counter created with 20 shards, so a cold
            video's few views land on as many rows as there were writers (up to 20)
* auto    - ``ShardedCount()``: every counter created with 1 shard; the hot ones grown
            to 16 before their views, as 16 writer processes grow them
            (``benchmarks/auto_shards.py``), the cold ones never

For each: the shard rows the page's sum reads, and the page's time (queryset evaluated
with its counts) with the values cached (one cache read) and with the cache missed (one
store query summing the rows: after a restart, or once ``cache_ttl`` has passed), medians
of ``--repeat`` reads with their spread, the modes taking turns. Every value read is
checked against the views written.

    python benchmarks/page_counts.py --cache redis://127.0.0.1:6379/12
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from rich.table import Table

from django_counts import DEFAULT_DATABASE, Site, prepare
from hot_counter import report_console

MODES = {"fixed20": 20, "auto": "auto"}
BASELINE = "fixed20"
GROWN = 16  # the hot videos' shards in the automatic mode


@dataclass
class Page:
    """One mode's videos, the views written to each, and its measures."""

    pks: list[int]
    views: dict[int, int]
    rows: int = 0
    cached: list[float] = field(default_factory=list)  # seconds per page read
    missed: list[float] = field(default_factory=list)
    exact: bool = True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", default=DEFAULT_DATABASE, help="PostgreSQL URL")
    parser.add_argument("--cache", default="memory://", help="cache URL (memory://)")
    parser.add_argument("--objects", type=int, default=50, help="videos on the page (50)")
    parser.add_argument("--hot", type=int, default=5, help="hot videos among them (5)")
    parser.add_argument("--hot-views", type=int, default=2000, help="a hot video's views")
    parser.add_argument("--threads", type=int, default=32, help="writing threads (32)")
    parser.add_argument("--repeat", type=int, default=15, help="page reads per measure (15)")
    return parser.parse_args(argv)


def write_views(views: dict[int, int], threads: int) -> None:
    """Each video's views, as counting updates by key dealt round-robin to ``threads``
    threads in a shuffled order."""
    from django.db import connections
    from django.db.models import F

    from videos.models import Video

    updates = [pk for pk, count in views.items() for _ in range(count)]
    random.Random(7).shuffle(updates)

    def write(share: list[int]) -> None:
        try:
            for pk in share:
                Video.objects.filter(pk=pk).update(views=F("views") + 1)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, [updates[i::threads] for i in range(threads)]))


def make_page(mode: str, args: argparse.Namespace, views_of: list[int]) -> Page:
    """``mode``'s videos, their views written."""
    from shardkit.contrib.django import kit
    from videos.models import Video

    tag = uuid.uuid4().hex[:8]
    videos = Video.objects.bulk_create(Video(title=f"page {tag} {i}") for i in range(args.objects))
    pks = [video.pk for video in videos]
    Video.views.shards = MODES[mode]
    if mode == "auto":
        for pk in pks[: args.hot]:
            kit().sharded(Video.views.counter_name(Video, pk)).grow(GROWN)
    page = Page(pks, dict(zip(pks, views_of, strict=True)))
    write_views(page.views, args.threads)
    return page


def shard_rows(page: Page) -> int:
    """The shard rows of the page's counters, which a sum of them reads."""
    import sqlalchemy as sa

    from shardkit.contrib.django import kit
    from videos.models import Video

    store = kit().store
    names = [Video.views.counter_name(Video, pk) for pk in page.pks]
    shards = store.shards_table  # type: ignore[attr-defined]
    with store.engine.connect() as conn:  # type: ignore[attr-defined]
        counted = sa.select(sa.func.count()).where(shards.c.name.in_(names))
        return int(conn.execute(counted).scalar_one())


def read_page(page: Page) -> Callable[[], float]:
    """The page's read: its queryset evaluated with its counts; each value checked."""
    from videos.models import Video

    def read() -> float:
        started = time.perf_counter()
        videos = list(Video.objects.filter(pk__in=page.pks).order_by("pk").with_counts("views"))
        took = time.perf_counter() - started
        page.exact = page.exact and all(v.views.value() == page.views[v.pk] for v in videos)
        return took

    return read


def forget_cached(page: Page) -> None:
    """Remove the page's cached values, as their expiry would."""
    from shardkit.contrib.django import kit
    from shardkit.counters.sharded import value_key
    from videos.models import Video

    for pk in page.pks:
        kit().cache.delete(value_key(kit().settings, Video.views.counter_name(Video, pk)))


def spread(seconds: list[float]) -> str:
    """A measure's median and spread, in ms."""
    ms = [s * 1000 for s in seconds]
    return f"{statistics.median(ms):.2f} ({min(ms):.2f} to {max(ms):.2f})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console()
    prepare(Site(args.database, args.cache))
    numbers = random.Random(11)
    views_of = [args.hot_views] * args.hot
    views_of += [numbers.randint(1, 40) for _ in range(args.objects - args.hot)]
    console.print(
        f"{args.objects} videos a page, {args.hot} of them with {args.hot_views:,} views, "
        f"the others {min(views_of[args.hot :])} to {max(views_of[args.hot :])}; "
        f"{sum(views_of):,} views a mode, by {args.threads} threads; cache {args.cache}"
    )
    pages: dict[str, Page] = {}
    for mode in MODES:
        with console.status(f"writing {mode}'s views…"):
            pages[mode] = make_page(mode, args, views_of)
        pages[mode].rows = shard_rows(pages[mode])
    modes = list(MODES)
    for number in range(args.repeat):
        turn = number % len(modes)
        for mode in modes[turn:] + modes[:turn]:
            page = pages[mode]
            read = read_page(page)
            read()  # cached from here on
            page.cached.append(read())
            forget_cached(page)
            page.missed.append(read())
    table = Table(title=f"A page of {args.objects} videos with their counts (ms, medians)")
    columns = ("mode", "shard rows read", "page, cached", "page, cache missed", "vs fixed20")
    for column in columns:
        table.add_column(column, justify="left" if column == "mode" else "right")
    base = statistics.median(pages[BASELINE].missed)
    for mode, page in pages.items():
        table.add_row(
            mode,
            f"{page.rows:,}",
            spread(page.cached),
            spread(page.missed),
            f"{statistics.median(page.missed) / base:.2f}x time, "
            f"{page.rows / pages[BASELINE].rows:.2f}x rows",
        )
    console.print(table)
    exact = all(page.exact for page in pages.values())
    console.print("every value exact" if exact else "[red]a value read was not the views written")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
