"""kit.map over string keys in the database's own order: collations that are not code-point
order (ICU, libc en_US, MariaDB's default utf8mb4_general_ci, SQLite's NOCASE) and keys
that are equal under the collation. Every row is visited exactly once.

PostgreSQL databases are created here, from template0 with the collation under test, and
dropped at the end (unique names: leftovers of a killed run are never reused). The libc
``en_US.UTF-8`` one lives on a throwaway server of the tests' own: a server loads the
machine's libc locales when it starts, so only one started after the locale was
generated (``.ci/run`` generates it) can use it.
"""

from __future__ import annotations

import random
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mapper import Unplanned, analyze

from backends import PREFIX, SESSION, STORE_URLS, Target, require, store_url_for
from servers import PostgresServer, unavailable
from shardkit.mapper import Batch, TableSource
from shardkit.store.sql import SqlStore

WAIT = 60.0  # seconds: a deadline, never a pause


# -- where: databases and collations -------------------------------------------------------


@dataclass(frozen=True)
class Place:
    """A database (see ``Databases``) and the collation of the key column there (None:
    the database's default)."""

    database: str
    collation: str | None = None


# Case- and accent-insensitive, and not deterministic: PostgreSQL compares by the
# collation alone, so 'a' and 'A' are equal there (as under utf8mb4_general_ci).
_PG_CI = (
    "CREATE COLLATION sk_ci (provider = icu, locale = 'und-u-ks-level1', deterministic = false)"
)
_PG_LOCALES = {
    "postgres-c": "LOCALE 'C'",
    "postgres-icu": "LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'",
    "postgres-en_US": "LOCALE 'en_US.UTF-8'",
}

PLACES = [
    Place("sqlite"),
    Place("sqlite", "NOCASE"),
    Place("postgres-c"),
    Place("postgres-icu"),
    Place("postgres-icu", "sk_ci"),
    Place("postgres-en_US"),
    Place("mariadb"),  # the test database's default: utf8mb4_general_ci
]


class Databases:
    """This module's databases by name, made on first use: the session's SQLite file,
    MariaDB's ``test`` database, and PostgreSQL databases created with a collation."""

    def __init__(self, sqlite_url: str) -> None:
        self.sqlite_url = sqlite_url
        self.urls: dict[str, str] = {}
        self.made: list[str] = []
        self._postgres = STORE_URLS["postgres"] or ""
        self._admins: dict[str, sa.Engine] = {}  # by server URL
        self._own: PostgresServer | None = None  # the en_US one

    def url(self, name: str) -> str:
        if name not in self.urls:
            self.urls[name] = self._make(name)
        return self.urls[name]

    def _make(self, name: str) -> str:
        if name in ("sqlite", "mariadb"):  # the kits' tables there are the session's
            return store_url_for("mysql" if name == "mariadb" else name, self.sqlite_url)
        server = self._own_server() if name == "postgres-en_US" else self._postgres
        require(server)
        database = f"sk_{name.split('-')[1].lower()}_{SESSION}_{uuid.uuid4().hex[:6]}"
        admin = self._admin(server)
        with admin.connect() as conn:
            conn.exec_driver_sql(
                f"CREATE DATABASE {database} TEMPLATE template0 ENCODING 'UTF8' "
                + _PG_LOCALES[name]
            )
        if server == self._postgres:
            self.made.append(database)
        url = sa.make_url(server).set(database=database).render_as_string(False)
        if name == "postgres-icu":
            engine = sa.create_engine(url)
            with engine.begin() as conn:
                conn.exec_driver_sql(_PG_CI)
            engine.dispose()
        return url

    def _own_server(self) -> str:
        if self._own is None:
            found = subprocess.run(["locale", "-a"], capture_output=True, text=True).stdout
            if "en_US.utf8" not in found.split():
                unavailable("the en_US.UTF-8 locale is not generated (.ci/run generates it)")
            self._own = PostgresServer()
            self._own.start()
        return self._own.url

    def _admin(self, server: str) -> sa.Engine:
        if server not in self._admins:
            self._admins[server] = sa.create_engine(server, isolation_level="AUTOCOMMIT")
        return self._admins[server]

    def drop(self) -> None:
        if self.made:
            with self._admin(self._postgres).connect() as conn:
                for database in self.made:
                    conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        for engine in self._admins.values():
            engine.dispose()
        if self._own is not None:
            self._own.close()  # its databases go with it


@pytest.fixture(scope="module")
def databases(sqlite_url: str) -> Iterator[Databases]:
    made = Databases(sqlite_url)
    yield made
    made.drop()


@dataclass(frozen=True)
class Where:
    """A place ready for tests: its URL and an engine of the tests' own."""

    url: str
    engine: sa.Engine
    collation: str | None


@pytest.fixture(
    scope="module",
    params=PLACES,
    ids=[f"{p.database}{'-' + p.collation if p.collation else ''}" for p in PLACES],
)
def where(request: pytest.FixtureRequest, databases: Databases) -> Iterator[Where]:
    place: Place = request.param
    url = databases.url(place.database)
    engine = sa.create_engine(url)
    yield Where(url, engine, place.collation)
    engine.dispose()


# -- keys ----------------------------------------------------------------------------------

# Mixed case, accents (composed), punctuation and spaces, digits.
CHARS = st.sampled_from([*"aAbBeEzZ09", *"éÉèßøØñÅ", *" -_.,'/:!~"])
PREFIXES = st.sampled_from(["", "", "Straße/", "straße/", "x" * 40, "X" * 40 + "-", "Kunde 7/"])
KEY = st.builds(lambda prefix, stem: prefix + stem, PREFIXES, st.text(CHARS, max_size=5))
# Keys that some collations hold equal to the key they are made from.
VARIANTS: list[Callable[[str], str]] = [
    str.upper,
    str.lower,
    str.swapcase,
    lambda key: key + " ",
    lambda key: key + "  ",
    lambda key: key.replace("e", "é"),
]


@st.composite
def key_lists(draw: st.DrawFn) -> list[str]:
    """Distinct strings, some of them variants of others (by case, accents or trailing
    spaces)."""
    keys = draw(st.lists(KEY, min_size=1, max_size=24))
    for key in list(keys):
        if draw(st.booleans()):
            keys.append(draw(st.sampled_from(VARIANTS))(key))
    return list(dict.fromkeys(keys))


def fixed_keys() -> list[str]:
    """400 keys over letters, digits, accents and punctuation: enough that interpolating
    between the root's bounds in code points misplaces points in most collations."""
    rng = random.Random(1)
    alphabet = "aAbBcCmMnNxXyYzZ0123456789éÉ -_.,/:!#~"
    drawn = ("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(400))
    return list(dict.fromkeys(drawn))


# -- tables and jobs -----------------------------------------------------------------------


@contextmanager
def made_table(where: Where, *columns: sa.Column[Any]) -> Iterator[sa.Table]:
    """A table of this test's own, dropped at the end."""
    table = sa.Table(f"{PREFIX}coll_{uuid.uuid4().hex[:8]}", sa.MetaData(), *columns)
    table.create(where.engine)
    try:
        yield table
    finally:
        table.drop(where.engine)


def key_column(where: Where, **options: Any) -> sa.Column[Any]:
    return sa.Column("k", sa.String(80, collation=where.collation), **options)


def row_id(table: sa.Table) -> str:
    """The column that tells a row of ``table``: ``id`` if it has one, else ``k``."""
    return "id" if "id" in table.c else "k"


def plus_one(table: sa.Table) -> Callable[[Batch], None]:
    """A transactional fn: adds 1 to ``v`` of each row of the page."""
    by = row_id(table)
    statement = sa.update(table).where(table.c[by] == sa.bindparam("p_by")).values(v=table.c.v + 1)

    def fn(batch: Batch) -> None:
        if batch.rows:
            batch.conn.execute(statement, [{"p_by": row[by]} for row in batch.rows])

    return fn


def map_once(
    where: Where,
    table: sa.Table,
    source: sa.Table | sa.Select[Any],
    key: Any,
    planned: bool,
    **options: Any,
) -> int:
    """Map ``source`` by ``key`` in a transactional job that adds 1 to ``v`` of every row
    of ``table`` it visits; return the rows the job counted. ``planned``: with the
    database's statistics, taken first (PostgreSQL's histogram is in the collation's
    order); else a source without them, split by key arithmetic."""
    if planned:
        analyze(where.engine, table)
    with Target(where.url, "memory://").connect() as kit:
        wrapped = TableSource(source, key) if planned else Unplanned(source, key)
        job = kit.map(wrapped, plus_one(table), transactional=True, **options)
        status = job.wait(WAIT)
    assert (status.state, status.error) == ("complete", None)
    return status.rows


def visits(where: Where, table: sa.Table) -> dict[Any, int]:
    """{row id: v} for every row of ``table``."""
    statement = sa.select(table.c[row_id(table)], table.c.v)
    with where.engine.connect() as conn:
        return {row[0]: row[1] for row in conn.execute(statement)}


def insert_keys(where: Where, table: sa.Table, keys: list[str]) -> list[str]:
    """Insert a row ``k = key, v = 0`` for each key the table's primary key admits (of
    keys equal under its collation, the first); return the keys it holds."""
    dialect = SqlStore(where.engine).dialect
    with where.engine.begin() as conn:
        dialect.insert_ignore_many(conn, table, [{"k": key, "v": 0} for key in keys])
        return list(conn.execute(sa.select(table.c.k)).scalars())


# -- every row once ------------------------------------------------------------------------


def test_fixed_mixed_keys_are_visited_once_each(where: Where) -> None:
    with made_table(
        where, key_column(where, primary_key=True), sa.Column("v", sa.Integer)
    ) as table:
        held = insert_keys(where, table, fixed_keys())
        rows = map_once(where, table, table, "k", True, page_size=7, fanout=8)
        assert visits(where, table) == dict.fromkeys(held, 1)
        assert rows == len(held)


@settings(max_examples=8, deadline=None)
@given(
    keys=key_lists(),
    page_size=st.integers(1, 6),
    fanout=st.integers(2, 6),
    planned=st.booleans(),
)
def test_a_unique_string_key_visits_every_row_once(
    where: Where, keys: list[str], page_size: int, fanout: int, planned: bool
) -> None:
    with made_table(
        where, key_column(where, primary_key=True), sa.Column("v", sa.Integer)
    ) as table:
        held = insert_keys(where, table, keys)
        rows = map_once(where, table, table, "k", planned, page_size=page_size, fanout=fanout)
        assert visits(where, table) == dict.fromkeys(held, 1)
        assert rows == len(held)


@settings(max_examples=8, deadline=None)
@given(
    keys=key_lists(),
    page_size=st.integers(1, 4),
    fanout=st.integers(2, 6),
    planned=st.booleans(),
    composite=st.booleans(),
    filtered=st.booleans(),
)
def test_keys_equal_under_the_collation_are_visited_once_each(
    where: Where,
    keys: list[str],
    page_size: int,
    fanout: int,
    planned: bool,
    composite: bool,
    filtered: bool,
) -> None:
    """A key that is unique as a string but not under the collation (a column that no
    unique index holds to it, alone or with a second column, or a select's): rows whose
    keys are equal there are one key to the mapper, and each is visited once."""
    columns = (
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        key_column(where, nullable=False, index=True),
        sa.Column("n", sa.Integer, nullable=False),
        sa.Column("v", sa.Integer),
    )
    with made_table(where, *columns) as table:
        rows = [{"id": i, "k": key, "n": i % 2, "v": 0} for i, key in enumerate(keys)]
        with where.engine.begin() as conn:
            conn.execute(table.insert(), rows)
        source = sa.select(table).where(table.c.id % 3 != 1) if filtered else table
        key = ("k", "n") if composite else "k"
        counted = map_once(where, table, source, key, planned, page_size=page_size, fanout=fanout)
        chosen = {row["id"]: int(not filtered or row["id"] % 3 != 1) for row in rows}
        assert visits(where, table) == chosen
        assert counted == sum(chosen.values())
