"""How a range task plans what follows a full page (``shardkit.mapper.planning``): the
arithmetic of cuts and estimates, and ``Planner.plan`` over a table of an in-memory
SQLite database (a backend of the product, no service)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from backends import wait_for
from shardkit.executor import LocalExecutor
from shardkit.mapper.keys import KeyRange
from shardkit.mapper.ledger import Child, RangeRow
from shardkit.mapper.planning import (
    Planner,
    _between,
    _children,
    _estimate_left,
    _has_nul,
    _inside,
    _targets,
    seek,
)
from shardkit.mapper.source import Statistics, TableSource
from shardkit.mapper.spec import MapSpec

KEYS = range(1000)  # the table's keys: 0 … 999


class Elsewhere:
    """An executor that is not the local one (as a Celery deployment is): only its type
    matters to a planner."""

    url = "elsewhere://"


@pytest.fixture
def table() -> Iterator[tuple[sa.Connection, TableSource]]:
    engine = sa.create_engine("sqlite://")
    metadata = sa.MetaData()
    rows = sa.Table("rows", metadata, sa.Column("k", sa.Integer, primary_key=True))
    with engine.connect() as conn:
        metadata.create_all(conn)
        conn.execute(rows.insert(), [{"k": key} for key in KEYS])
        yield conn, TableSource(rows, "k")
    engine.dispose()


def spec_of(source: TableSource, page_size: int = 10, fanout: int = 4) -> MapSpec:
    return MapSpec(source, lambda conn, rows: None, None, page_size, fanout, False, 0)  # type: ignore[arg-type]


def range_row(
    rng: KeyRange | None = None, depth: int = 0, visited: int = 0, planned: int | None = None
) -> RangeRow:
    """A range of the ledger (by default the root: every key)."""
    return RangeRow("r", rng or KeyRange(), None, depth, visited, planned)


def page(conn: sa.Connection, source: TableSource, rng: KeyRange, size: int) -> list[Any]:
    return list(source.page(conn, rng, None, size))


def plan_after(
    conn: sa.Connection,
    source: TableSource,
    row: RangeRow,
    rows: list[Any],
    last: Any,
    statistics: Statistics,
) -> Any:
    """What a planner with every other worker busy plans for ``row`` after ``rows``."""
    return Planner(Elsewhere()).plan(conn, spec_of(source), row, rows, last, statistics)  # type: ignore[arg-type]


# --- the arithmetic ---------------------------------------------------------------------


def test_targets_cut_two_edges_evenly_by_key_arithmetic() -> None:
    # Between 10 and 999, at a quarter, a half and three quarters, to a 64th.
    assert _targets([10, 999], 4) == [257, 504, 751]
    assert _targets([10, 999], 2) == [504]
    assert _targets([10, 999], 1) == []


def test_targets_cut_a_histogram_at_equal_shares_of_its_buckets() -> None:
    edges = [0, 10, 100, 1000, 10_000]  # four buckets of about equal rows
    assert _targets(edges, 4) == [10, 100, 1000]  # on the bounds themselves
    assert _targets(edges, 2) == [100]
    # A third of the way is 4/3 buckets in: 21/64 of the second bucket (10 … 100); two
    # thirds, 43/64 of the third (100 … 1000).
    assert _targets(edges, 3) == [10 + 90 * 21 // 64, 100 + 900 * 43 // 64]


def test_targets_step_a_64th_of_a_bucket_and_land_on_the_edges_at_its_ends() -> None:
    assert _targets([0, 6400], 64)[:2] == [100, 200]  # a 64th in: not the edge itself
    assert _targets([0, 6400], 128)[-2:] == [6300, 6400]  # 63.5/64 rounds to the end
    assert _targets([0, 5, 5, 10], 3) == [5]  # each once
    # 255/256 of two buckets rounds to the end of the second: its upper edge.
    assert _targets([0, 6400, 12800], 256) == list(range(0, 12801, 100))


def test_targets_over_strings_use_the_alphabet_of_the_bounds() -> None:
    # A histogram of two buckets or more: its bounds' alphabet.
    assert _targets(["a0", "a8", "b0"], 4) == ["a0a", "a8", "aaa"]
    # Two edges only (no histogram): code points.
    assert _targets(["10", "20"], 2) == ["1\U00088430"]
    assert _targets(["X", "XX"], 2) == ["X,"]
    edges = ["a0", "a8", "b0", "b8"]
    targets = _targets(edges, 6)
    assert all(set(target) <= set("ab08") for target in targets)
    assert targets == sorted(set(targets))
    assert len(targets) == 5


def test_targets_drop_keys_with_nul_and_repeated_or_crossed_cuts() -> None:
    # No room between "item1" and "item1\x01" but "item1\x00…": no cut at all.
    assert _targets(["item1", "item1\x01"], 4) == []
    # Adjacent ints: every cut falls on an edge or has no room; each kept once.
    assert _targets([0, 1, 2], 8) == [1]
    # Keys Python cannot order (a NULL in a composite key): each once, in the order found.
    edges = [(0, 0), (1, None), (1, None), (1, "x"), (2, 0)]
    assert _targets(edges, 4) == [(1, None), (1, "x")]
    # Edges out of Python's order (bounds in a collation's): a cut below the last dropped.
    assert _targets([0, 10, 5, 20], 3) == [10]


def test_inside_steps_a_64th_at_a_time_or_to_the_nearest_room() -> None:
    assert _inside(0, 640, 1, "") == 10
    assert _inside(0, 640, 32, "") == 320
    assert _inside(0, 640, 63, "") == 630
    assert _inside(0, 4, 32, "") == 2  # three points only: the middle one
    assert _inside(0, 1, 32, "") is None  # no room
    assert _inside(1, "a", 32, "") is None  # no arithmetic between them
    assert _inside("a", "c", 32, "abc") == "b"


def test_inside_composite_keys_without_room_step_to_the_next_first_part() -> None:
    assert _inside((1, 5), (2, 9), 32, "") == (2, 5)
    assert _inside((1, 5), (2, 3), 32, "") is None  # (2, 5) is past hi
    assert _inside((1, 5), (1, 6), 32, "") is None  # nothing between, nothing to step
    assert _inside((1, 5), (1, 5), 32, "") is None  # equal: no part differs
    assert _inside((1, 5, 7), (2, 9, 9), 32, "") == (2, 5, 7)
    assert _inside((1, None), (2, 3), 32, "") is None  # parts Python cannot compare


def test_has_nul_looks_into_every_string_part() -> None:
    assert _has_nul("a\0")
    assert _has_nul((1, "a\0b"))
    assert not _has_nul("a")
    assert not _has_nul((1, b"\0"))  # bytes may hold NUL
    assert not _has_nul(0)


def test_between_keeps_the_bounds_past_after_and_below_high() -> None:
    bounds = [10, 20, 30, 40]
    assert _between(bounds, None, 40) == [10, 20, 30]
    assert _between(bounds, 10, 40) == [20, 30]
    assert _between(bounds, 5, 31) == [10, 20, 30]
    assert _between([1, "a"], 0, 5) == []  # cannot compare: none


def test_children_share_the_rows_left_and_the_first_keeps_the_checkpoint() -> None:
    children = _children(KeyRange(0, 100), [30, 60], 12, 301)
    assert children == [
        Child(KeyRange(0, 30), 12, 101),
        Child(KeyRange(30, 60), None, 101),
        Child(KeyRange(60, 100), None, 101),
    ]
    assert _children(KeyRange(0, 100), [50], None, None) == [
        Child(KeyRange(0, 50), None, None),
        Child(KeyRange(50, 100), None, None),
    ]


STATS = Statistics(1000, [100, 200, 300, 400, 500, 600, 700, 800, 900, 999])


@pytest.mark.parametrize(
    ("stats", "row", "done", "inside", "density", "left"),
    [
        # Within a plan: what the plan leaves, or the density if smaller.
        (STATS, range_row(depth=1, planned=500), 100, [], None, 400),
        (STATS, range_row(depth=1, planned=500), 100, [], 300, 300),
        (STATS, range_row(depth=1, planned=500), 100, [], 450, 400),
        # The root: the larger of the density and the rows not done, at most the rows.
        (STATS, range_row(), 100, [], None, 900),
        (STATS, range_row(), 100, [], 950, 950),
        (STATS, range_row(), 100, [], 5000, 1000),
        (Statistics(None), range_row(), 100, [], 5000, 5000),
        (Statistics(None), range_row(), 100, [], None, None),
        (Statistics(2000), range_row(), 3000, [], None, 0),  # never below nothing
        # Past a plan, deeper: the histogram's buckets past the page (3 of 9).
        (STATS, range_row(depth=1, planned=50), 100, [700, 800, 900], None, 333),
        (STATS, range_row(depth=1, planned=50), 100, [700, 800, 900], 2000, 2000),
        (STATS, range_row(depth=1, planned=50), 100, [], None, 50),  # nothing tells
        (Statistics(1000, [5]), range_row(depth=1, planned=50), 100, [5], None, 50),
        (STATS, range_row(depth=1), 100, [700], None, 111),
        (Statistics(1000, [0, 999]), range_row(depth=1, planned=50), 100, [0], None, 1000),
    ],
)
def test_the_rows_left_are_estimated_from_the_plan_the_page_and_the_statistics(
    stats: Statistics,
    row: RangeRow,
    done: int,
    inside: list[Any],
    density: int | None,
    left: int | None,
) -> None:
    assert _estimate_left(stats, row, done, inside, density) == left


# --- seek and plan --------------------------------------------------------------------------


def test_seek_finds_the_real_keys_at_or_above_each_target_and_above_the_last(
    table: tuple[sa.Connection, TableSource],
) -> None:
    conn, source = table
    assert seek(conn, source, KeyRange(None, 500), 9, [100.5, 300, 300, 10]) == [101, 300, 301, 302]
    assert seek(conn, source, KeyRange(None, 500), 9, [499, 600]) == [499]  # none past hi
    assert seek(conn, source, KeyRange(), 998, [10]) == [999]
    assert seek(conn, source, KeyRange(), 999, [10]) == []


def test_a_short_page_ends_the_range(table: tuple[sa.Connection, TableSource]) -> None:
    conn, source = table
    row = range_row(KeyRange(995, None), depth=1, planned=7)
    rows = page(conn, source, row.range, 10)
    assert plan_after(conn, source, row, rows, 999, STATS) == ([], 7)


def test_a_fanout_of_one_goes_on_in_place(table: tuple[sa.Connection, TableSource]) -> None:
    conn, source = table
    rows = page(conn, source, KeyRange(), 10)
    plan = Planner(Elsewhere()).plan(conn, spec_of(source, fanout=1), range_row(), rows, 9, STATS)  # type: ignore[arg-type]
    assert plan == (None, None)


def test_the_root_splits_into_fanout_children_planned_at_its_estimate(
    table: tuple[sa.Connection, TableSource],
) -> None:
    conn, source = table
    rows = page(conn, source, KeyRange(), 10)
    children, planned = Planner(Elsewhere()).plan(  # type: ignore[arg-type]
        conn, spec_of(source), range_row(), rows, 9, Statistics(1000)
    )
    assert planned is None
    # 990 keys left, the page's density says 1,100: 1,000 at most, the rows; leaves of
    # 62 rows (1,000 over fanout**2): 4 children, cut evenly between 10 and 999.
    assert children == [
        Child(KeyRange(None, 257), 9, 250),
        Child(KeyRange(257, 504), None, 250),
        Child(KeyRange(504, 751), None, 250),
        Child(KeyRange(751, None), None, 250),
    ]


def test_the_root_cuts_at_the_histogram_when_it_has_bounds_inside(
    table: tuple[sa.Connection, TableSource],
) -> None:
    conn, source = table
    rows = page(conn, source, KeyRange(), 10)
    stats = Statistics(1000, [0, 250, 400, 600, 999])  # four buckets of about 250 rows
    children, _ = Planner(Elsewhere()).plan(conn, spec_of(source), range_row(), rows, 9, stats)  # type: ignore[arg-type]
    assert [child.range for child in children or []] == [
        KeyRange(None, 250),
        KeyRange(250, 400),
        KeyRange(400, 600),
        KeyRange(600, None),
    ]


def test_a_range_within_its_leaf_goes_on_in_place_planned_at_what_is_left(
    table: tuple[sa.Connection, TableSource],
) -> None:
    conn, source = table
    row = range_row(KeyRange(500, 600), depth=1, visited=40, planned=100)
    rows = page(conn, source, KeyRange(540, 600), 10)
    plan = plan_after(conn, source, row, rows, 549, Statistics(1000))
    assert plan == (None, 100)  # 50 left of its plan: within a leaf of 62


def test_a_small_range_past_its_plan_goes_on_planned_at_its_estimate(
    table: tuple[sa.Connection, TableSource],
) -> None:
    conn, source = table
    row = range_row(KeyRange(500, 560), depth=1, visited=40, planned=50)
    rows = page(conn, source, KeyRange(540, 560), 10)
    plan = plan_after(conn, source, row, rows, 549, Statistics(1000))
    # Past its plan: 10 keys a page over 9 of key space, 10 more up to 559: 11 rows.
    assert plan == (None, 61)


def test_a_range_with_no_room_for_a_cut_goes_on_at_its_estimate(
    table: tuple[sa.Connection, TableSource],
) -> None:
    conn, source = table
    row = range_row(KeyRange(0, 12), depth=1, planned=5)
    rows = page(conn, source, row.range, 10)
    # The histogram puts half a million rows past the page (a bound, 10, of 2 buckets):
    # more than a leaf, but only the keys 10 and 11 are left, with no room between.
    stats = Statistics(10**6, [0, 10, 20])
    plan = plan_after(conn, source, row, rows, 9, stats)
    assert plan == (None, 10 + 500_000)


def test_a_fanout_of_two_splits_in_two(table: tuple[sa.Connection, TableSource]) -> None:
    conn, source = table
    rows = page(conn, source, KeyRange(), 10)
    children, _ = Planner(Elsewhere()).plan(  # type: ignore[arg-type]
        conn, spec_of(source, fanout=2), range_row(), rows, 9, Statistics(1000)
    )
    assert [child.range for child in children or []] == [KeyRange(None, 504), KeyRange(504, None)]


@pytest.mark.parametrize("left", [1, 40])
def test_a_range_with_a_leaf_or_less_of_its_plan_left_goes_on_in_place(
    table: tuple[sa.Connection, TableSource], left: int
) -> None:
    conn, source = table
    row = range_row(KeyRange(500, 585), depth=1, visited=70, planned=80 + left)
    rows = page(conn, source, KeyRange(570, 585), 10)
    # No statistics: a leaf is fanout pages, 40 rows; the keys left (580 … 584) would
    # plan fewer.
    plan = plan_after(conn, source, row, rows, 579, Statistics(None))
    assert plan == (None, 80 + left)


def test_a_full_page_ending_its_range_within_its_plan_goes_on_in_place(
    table: tuple[sa.Connection, TableSource],
) -> None:
    conn, source = table
    row = range_row(KeyRange(500, 580), depth=1, visited=70, planned=81)
    rows = page(conn, source, KeyRange(570, 580), 10)
    # One row left of the plan, none of the range: in place, as planned (the next page,
    # empty, ends it).
    plan = plan_after(conn, source, row, rows, 579, Statistics(None))
    assert plan == (None, 81)


def test_a_range_past_its_plan_with_a_leaf_left_goes_on_in_place(
    table: tuple[sa.Connection, TableSource],
) -> None:
    conn, source = table
    row = range_row(KeyRange(500, 546), depth=1, visited=50, planned=50)
    rows = page(conn, source, row.range, 10)
    # Keys 500 … 509 on the page, 36 more of key space up to 545: 4 pages, 40 rows, a leaf.
    plan = plan_after(conn, source, row, rows, 509, Statistics(None))
    assert plan == (None, 100)


def test_a_range_past_its_plan_splits_into_the_leaves_its_estimate_holds(
    table: tuple[sa.Connection, TableSource],
) -> None:
    conn, source = table
    row = range_row(KeyRange(500, 600), depth=1, visited=50, planned=50)
    rows = page(conn, source, row.range, 10)
    # 90 of key space up to 599: 10 pages, 100 rows; leaves of 40: 3 children, cut at a
    # third and two thirds of 510 … 599.
    plan = plan_after(conn, source, row, rows, 509, Statistics(None))
    assert plan == (
        [
            Child(KeyRange(500, 539), 509, 34),
            Child(KeyRange(539, 569), None, 34),
            Child(KeyRange(569, 600), None, 34),
        ],
        50,
    )


def test_keys_without_arithmetic_go_on_planned_at_fanout_leaves() -> None:
    engine = sa.create_engine("sqlite://")
    metadata = sa.MetaData()
    reals = sa.Table("reals", metadata, sa.Column("k", sa.Float, primary_key=True))
    with engine.connect() as conn:
        metadata.create_all(conn)
        conn.execute(reals.insert(), [{"k": key / 2} for key in KEYS])
        source = TableSource(reals, "k")
        rows = page(conn, source, KeyRange(), 10)
        plan = Planner(Elsewhere()).plan(
            conn, spec_of(source), range_row(), rows, 4.5, Statistics(None)
        )  # type: ignore[arg-type]
    engine.dispose()
    # Nothing tells what is left: fanout leaves of 40 rows; no cut between floats.
    assert plan == (None, 10 + 4 * 40)


def test_a_leaf_is_a_whole_number_of_rows() -> None:
    engine = sa.create_engine("sqlite://")
    metadata = sa.MetaData()
    reals = sa.Table("reals", metadata, sa.Column("k", sa.Float, primary_key=True))
    with engine.connect() as conn:
        metadata.create_all(conn)
        conn.execute(reals.insert(), [{"k": key / 2} for key in KEYS])
        source = TableSource(reals, "k")
        rows = page(conn, source, KeyRange(), 10)
        row = range_row(depth=1)  # no plan, no histogram: nothing tells what is left
        plan = plan_after(conn, source, row, rows, 4.5, Statistics(1001))
    engine.dispose()
    # Leaves of 62 rows (1,001 over fanout**2, rounded down): fanout of them.
    assert plan == (None, 10 + 4 * 62)


def reverse(a: str, b: str) -> int:
    """A collation: strings in the reverse of Python's order."""
    return (a < b) - (a > b)


def test_bounds_in_another_order_than_pythons_are_cut_in_the_databases() -> None:
    engine = sa.create_engine("sqlite://")
    sa.event.listen(
        engine, "connect", lambda dbapi, record: dbapi.create_collation("reverse", reverse)
    )
    metadata = sa.MetaData()
    words = sa.Table(
        "words", metadata, sa.Column("k", sa.String(collation="reverse"), primary_key=True)
    )
    keys = [f"{n:03}" for n in KEYS]  # "999" first in the database's order, "000" last
    with engine.connect() as conn:
        metadata.create_all(conn)
        conn.execute(words.insert(), [{"k": key} for key in keys])
        source = TableSource(words, "k")
        rows = page(conn, source, KeyRange(), 10)
        assert [source.key_of(r) for r in rows] == keys[:-11:-1]
        plan = Planner(Elsewhere()).plan(  # type: ignore[arg-type]
            conn, spec_of(source), range_row(), rows, "990", Statistics(1000)
        )
    engine.dispose()
    # The bounds past "990" are ("989", "000"): the arithmetic runs from "000" to "989" in
    # Python's order, its cuts placed at the keys past them in the database's: uneven
    # pieces, each a real range of keys.
    assert plan == (
        [
            Child(KeyRange(None, "299"), "990", 248),
            Child(KeyRange("299", "298"), None, 248),
            Child(KeyRange("298", "297"), None, 248),
            Child(KeyRange("297", None), None, 248),
        ],
        None,
    )


def backwards(a: str, b: str) -> int:
    """A collation: strings by their characters from the last ("100" before "010")."""
    return (a[::-1] > b[::-1]) - (a[::-1] < b[::-1])


def test_cuts_are_sought_past_the_checkpoint_in_the_databases_order() -> None:
    engine = sa.create_engine("sqlite://")
    sa.event.listen(
        engine, "connect", lambda dbapi, record: dbapi.create_collation("backwards", backwards)
    )
    metadata = sa.MetaData()
    words = sa.Table(
        "words", metadata, sa.Column("k", sa.String(collation="backwards"), primary_key=True)
    )
    with engine.connect() as conn:
        metadata.create_all(conn)
        conn.execute(words.insert(), [{"k": f"{n:03}"} for n in KEYS])
        source = TableSource(words, "k")
        rows = page(conn, source, KeyRange(), 10)
        assert [source.key_of(r) for r in rows] == [f"{n}00" for n in range(10)]
        # A histogram bound "9000" (past "900" in Python's order, before it in the
        # database's): the first cut, sought past the first key left, "010".
        stats = Statistics(1000, ["9000", "950", "990"])
        plan = Planner(Elsewhere()).plan(conn, spec_of(source), range_row(), rows, "900", stats)  # type: ignore[arg-type]
    engine.dispose()
    assert plan == (
        [
            Child(KeyRange(None, "110"), "900", 248),
            Child(KeyRange("110", "950"), None, 248),
            Child(KeyRange("950", "990"), None, 248),
            Child(KeyRange("990", None), None, 248),
        ],
        None,
    )


def test_bounds_python_cannot_order_keep_the_databases_order() -> None:
    engine = sa.create_engine("sqlite://")
    metadata = sa.MetaData()
    pairs = sa.Table("pairs", metadata, sa.Column("a", sa.Integer), sa.Column("b", sa.Integer))
    with engine.connect() as conn:
        metadata.create_all(conn)
        rest = [{"a": 1, "b": None}, {"a": 1, "b": 5}]  # (1, NULL) first in SQLite's order
        conn.execute(pairs.insert(), [{"a": 0, "b": n} for n in range(10)] + rest)
        source = TableSource(pairs, ["a", "b"])
        rows = page(conn, source, KeyRange(), 10)
        plan = Planner(Elsewhere()).plan(  # type: ignore[arg-type]
            conn, spec_of(source), range_row(), rows, (0, 9), Statistics(None)
        )
    engine.dispose()
    # Nothing tells what is left: fanout leaves of 40 rows; no room for a cut.
    assert plan == (None, 10 + 4 * 40)


@pytest.fixture
def executor() -> Iterator[LocalExecutor]:
    """A local executor of 4 workers, all idle."""
    the_executor = LocalExecutor(workers=4)
    the_executor.bind({"nothing": lambda args: None}, None)  # type: ignore[arg-type]
    the_executor.submit("nothing", {})
    wait_for(lambda: the_executor.idle == 4, "4 idle workers")
    yield the_executor
    the_executor.close()


def test_a_range_within_its_plan_splits_for_idle_workers(
    table: tuple[sa.Connection, TableSource], executor: LocalExecutor
) -> None:
    conn, source = table
    planner = Planner(executor)
    row = range_row(KeyRange(100, 600), depth=1, visited=90, planned=500)
    rows = page(conn, source, KeyRange(190, 600), 10)
    # A leaf is 2,000 rows / 4 workers; 400 left of the plan, within it: a share for
    # itself and each of 3 idle workers (fanout - 1), 100 rows each, cut evenly from 200.
    children, planned = planner.plan(conn, spec_of(source), row, rows, 199, Statistics(2000))
    assert planned == 500
    assert [(child.range, child.planned) for child in children or []] == [
        (KeyRange(100, 299), 100),
        (KeyRange(299, 399), 100),
        (KeyRange(399, 499), 100),
        (KeyRange(499, 600), 100),
    ]
    # The 3 workers stay claimed by this thread until it unclaims them.
    assert planner._claim(3) == 1
    planner.unclaim()
    assert planner._claim(3) == 3


@pytest.mark.parametrize(
    ("planned", "share"),
    [
        # 100 rows left of the plan: 2 pieces of fanout pages (40 rows) at most, so 1 idle
        # worker claimed, and 50 rows each.
        pytest.param(200, 50, id="as-many-idle-workers-as-fanout-pages"),
        # 91 rows left of the plan: 1 idle worker, two shares of 46 rows (not three of 45).
        pytest.param(191, 46, id="a-share-for-itself-and-each-idle-worker"),
    ],
)
def test_a_range_splits_into_a_share_for_itself_and_each_idle_worker(
    table: tuple[sa.Connection, TableSource], executor: LocalExecutor, planned: int, share: int
) -> None:
    conn, source = table
    row = range_row(KeyRange(100, 600), depth=1, visited=90, planned=planned)
    rows = page(conn, source, KeyRange(190, 600), 10)
    plan = Planner(executor).plan(conn, spec_of(source), row, rows, 199, Statistics(2000))
    assert plan == (
        [Child(KeyRange(100, 399), 199, share), Child(KeyRange(399, 600), None, share)],
        planned,
    )


def test_a_range_whose_estimate_is_a_share_goes_on_in_place(
    table: tuple[sa.Connection, TableSource], executor: LocalExecutor
) -> None:
    conn, source = table
    row = range_row(KeyRange(100, 241), depth=1, visited=90, planned=191)
    rows = page(conn, source, KeyRange(190, 241), 10)
    # 91 rows left of the plan, a share of 46 for 1 idle worker; the page's density says
    # 46 (41 of key space up to 240 over 9 for 10 rows): a share, in place.
    plan = Planner(executor).plan(conn, spec_of(source), row, rows, 199, Statistics(2000))
    assert plan == (None, 100 + 46)


def test_no_worker_is_claimed_when_none_is_idle() -> None:
    assert Planner(LocalExecutor(workers=2))._claim(2) == 0  # no thread started yet


def test_a_claim_of_one_idle_worker(executor: LocalExecutor) -> None:
    planner = Planner(executor)
    assert planner._claim(1) == 1
    planner.unclaim()
    assert planner._claim(4) == 4
    assert planner._claim(1) == 0  # every idle worker claimed (by this thread)


def test_a_lone_idle_worker_is_claimed() -> None:
    executor = LocalExecutor(workers=1)
    executor.bind({"nothing": lambda args: None}, None)  # type: ignore[arg-type]
    executor.submit("nothing", {})
    wait_for(lambda: executor.idle == 1, "1 idle worker")
    try:
        assert Planner(executor)._claim(3) == 1
    finally:
        executor.close()


def test_unclaiming_releases_only_this_threads_claim(executor: LocalExecutor) -> None:
    import threading

    planner = Planner(executor)
    other = threading.Thread(target=lambda: planner._claim(2))
    other.start()
    other.join(30)
    planner.unclaim()  # this thread claimed nothing
    assert list(planner._claims.values()) == [2]


def test_claims_are_at_most_the_idle_workers_no_run_claimed(executor: LocalExecutor) -> None:
    planner = Planner(executor)
    assert planner._claim(0) == 0
    assert planner._claim(2) == 2
    assert planner._claims == {threading_ident(): 2}
    planner.unclaim()
    assert planner._claims == {}
    assert planner._claim(9) == 4
    assert Planner(Elsewhere())._claim(3) == 0  # type: ignore[arg-type]


def test_a_job_aims_at_a_leaf_per_local_worker_or_fanout_squared_elsewhere(
    table: tuple[sa.Connection, TableSource],
) -> None:
    _, source = table
    assert Planner(LocalExecutor(workers=3))._leaves(spec_of(source, fanout=4)) == 3
    assert Planner(Elsewhere())._leaves(spec_of(source, fanout=4)) == 16  # type: ignore[arg-type]


def threading_ident() -> int:
    import threading

    return threading.get_ident()
