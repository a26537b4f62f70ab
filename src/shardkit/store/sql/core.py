"""The SQL stores' rules, shared by the blocking store (``SqlStore``) and the asyncio one:
their tables, statements and programs (``SqlCore``), run on the role ``Sql``."""

from __future__ import annotations

import random
import secrets
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from shardkit import _urls
from shardkit._program import Program, Roles, call, role, rule
from shardkit.errors import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    CounterKindMismatch,
    CounterOverflow,
    InvalidDelta,
    ShardkitError,
)
from shardkit.store.base import IDS, RETIRED, CounterInfo, Deleted, Flushed, check_reset
from shardkit.validation import sums_fit

from .dialect import COMMIT, Dialect, added, greatest_of
from .schema import Tables, missing_tables

_T = TypeVar("_T")
_DEADLOCK_RETRIES = 5


@role("sql")
class Sql(Protocol):
    """The role of a SQL store's driver in the store's programs: how a statement is run,
    blocking (``SqlStore``) or on an event loop (``shardkit.aio``'s store)."""

    def read(self, action: str, statement: sa.Executable, *, autocommit: bool = False) -> list[Any]:
        """Run a query and return its rows; with ``autocommit``, outside any transaction
        (no BEGIN or ROLLBACK around it: it sees whatever was committed before it)."""
        ...

    def transaction(self, action: str, work: Callable[[Connection], _T]) -> _T:
        """Run ``work`` in one transaction, again if the database chose it as a deadlock
        victim (its effects were rolled back whole, so running it again is safe)."""
        ...

    def fast_add(self, params: Mapping[str, Any]) -> None:
        """Run the shard upsert with ``params`` in one round trip, committed at once."""
        ...


@dataclass(frozen=True, slots=True)
class SqlRoles(Roles):
    """What a SQL store's programs run on."""

    sql: Sql


class SqlCore(Tables):
    """What the sync and async SQL stores share: the tables (``Tables``), the statements
    and the rules (``Store``'s methods, as programs run on ``SqlRoles``)."""

    combinable = True  # its writes run on connections of its own
    roles: SqlRoles

    def __init__(self, dialect: sa.Dialect, url: sa.URL, *, prefix: str) -> None:
        self.url = url.render_as_string(hide_password=True)
        self._password = url.password
        self._database = url.database
        if dialect.name not in ("sqlite", "postgresql", "mysql", "mariadb"):
            raise ConfigurationError(f"unsupported SQL database {dialect.name!r}")
        self.dialect = Dialect(dialect.name)
        self.row_locks = dialect.name != "sqlite"  # SQLite: one lock for the database
        super().__init__(prefix)
        self._upsert_add = self.dialect.upsert(self.shards_table, {"value": added})
        self._fold = self.dialect.upsert(self.flushed_table, {"up": added, "down": added})
        self._raise_max = self.dialect.upsert(self.maxima_table, {"value": greatest_of})
        self._reserve_block = self.dialect.upsert(self.marks_table, {"mark": added})
        counters = self.counters_table
        self._info = sa.select(
            counters.c.name, counters.c.kind, counters.c.shards, counters.c.incarnation
        )
        self._identity: str | None = None

    # -- errors ------------------------------------------------------------------------

    def _error(self, exc: Exception, action: str, *, lost: bool = False) -> ShardkitError:
        """The ``BackendError`` for a failure of the store; ``BackendUnavailable`` when the
        connection was ``lost`` (or SQLAlchemy found it so) or could not be made, and
        ``CounterOverflow`` when the database refused a value outside signed 64-bit (so
        nothing was written). A lost connection means the server went away: the held
        connections are dropped too. A failed ``COMMIT`` sent with a statement (a
        ``DBAPIError`` naming ``COMMIT``) is told as ``committing``."""
        if isinstance(exc, DBAPIError) and exc.statement == COMMIT:
            action = committing(action)
        text = _urls.scrub(str(getattr(exc, "orig", None) or exc), self._password)
        detail = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        if self.dialect.is_out_of_range(exc):
            return CounterOverflow(
                f"store {self.url} refused, while {action}, a value outside signed 64-bit; "
                "nothing was written"
            )
        if lost or (isinstance(exc, DBAPIError) and exc.connection_invalidated):
            self._drop_held()
            return BackendUnavailable(f"lost the store at {self.url} while {action}: {detail}")
        if isinstance(exc, sa.exc.OperationalError) and "connect" in detail.lower():
            return BackendUnavailable(f"cannot reach the store at {self.url}: {detail}")
        return BackendError(f"store {self.url} failed while {action}: {detail}")

    def _pause_before_retry(self, exc: SQLAlchemyError, action: str, attempt: int) -> float:
        """How long to wait before running a transaction again, after its ``attempt``
        (from 0) failed with ``exc``: only a deadlock victim is run again, a few times
        (its effects were rolled back whole); any other failure raises its
        ``ShardkitError``."""
        if (
            isinstance(exc, DBAPIError)
            and self.dialect.is_deadlock(exc)
            and attempt < _DEADLOCK_RETRIES
        ):
            return random.uniform(0, 0.01 * 2**attempt)  # let the winner finish
        raise self._error(exc, action) from exc

    def _drop_held(self) -> None:
        """Let go of connections held for fast writes (they died with the server)."""

    # -- schema ------------------------------------------------------------------------

    @rule
    def create_schema(self) -> Program[None]:
        """See ``Store.create_schema``: the tables where missing (``create_tables``),
        ``ConfigurationError`` for tables of a development version (``check_current``)."""
        if self.dialect.name == "sqlite" and self._database:
            yield from call(
                Sql.transaction,
                "creating the schema",
                lambda conn: conn.exec_driver_sql("PRAGMA journal_mode=WAL"),
            )
        yield from SqlCore.create_tables.program(self, self.metadata, self.check_current)

    @rule
    def create_tables(
        self, metadata: sa.MetaData, upgrade: Callable[[Connection], None]
    ) -> Program[None]:
        """Create ``metadata``'s tables where missing, then run ``upgrade`` (checks or
        additions that tables of an earlier version need), in one transaction.
        Concurrent callers may race: a loser's "already exists" error is absorbed by
        another, checking, attempt. Each failed attempt means a racer created a table
        meanwhile, so one attempt per table (and one more) is enough however the racers
        interleave."""

        def work(conn: Connection) -> None:
            metadata.create_all(conn, tables=missing_tables(conn, metadata), checkfirst=False)
            upgrade(conn)

        attempts = len(metadata.tables) + 1
        racing = (sa.exc.ProgrammingError, sa.exc.IntegrityError, sa.exc.OperationalError)
        for attempt in range(attempts):
            try:
                yield from call(Sql.transaction, "creating the schema", work)
                return
            except BackendError as exc:
                if attempt == attempts - 1 or not isinstance(exc.__cause__, racing):
                    raise

    @rule
    def identity(self) -> Program[str]:
        """See ``Store.identity``."""
        if self._identity is None:
            table = self.identity_table
            found = yield from call(
                Sql.read, "reading the store's identity", sa.select(table.c.identity)
            )
            if not found:  # a new store: the first to record its identity wins

                def work(conn: Connection) -> Any:
                    made = {"one": 1, "identity": uuid.uuid4().hex}
                    self.dialect.insert_ignore(conn, table, made)
                    return conn.execute(sa.select(table.c.identity)).all()

                found = yield from call(Sql.transaction, "recording the store's identity", work)
            self._identity = str(found[0].identity)
        return self._identity

    # -- counters ----------------------------------------------------------------------

    @rule
    def open_counter(
        self, name: str, kind: str, shards: int, *, grow: bool = True
    ) -> Program[CounterInfo]:
        """See ``Store.open_counter``."""
        table = self.counters_table

        def work(conn: Connection) -> Any:
            # Growing first takes the row's write lock at once; inserting first would take
            # a shared lock on an existing row and then need to upgrade it, which deadlocks
            # against a concurrent opener doing the same on MySQL.
            if grow:
                conn.execute(
                    sa.update(table)
                    .where(table.c.name == name, table.c.kind == kind, table.c.shards < shards)
                    .values(shards=shards)
                )
            self._insert_counter(conn, {"name": name, "kind": kind, "shards": shards})
            return conn.execute(self._info.where(table.c.name == name)).one()

        found = yield from call(Sql.transaction, f"opening counter {name!r}", work)
        if found.kind != kind:
            raise CounterKindMismatch(f"{name!r} is a {found.kind} counter, not a {kind} counter")
        return _info(found)

    def _insert_counter(self, conn: Connection, made: Mapping[str, Any]) -> bool:
        """Insert a counter's row, a new incarnation, unless the name has one; return
        whether it did."""
        row = {**made, "incarnation": new_incarnation()}
        return self.dialect.insert_ignore(conn, self.counters_table, row)

    @rule
    def delete(self, name: str, *, reset: bool = False) -> Program[Deleted | None]:
        """See ``Store.delete``."""
        counters, flushed = self.counters_table, self.flushed_table
        this = counters.c.name == name

        def work(conn: Connection) -> Deleted | None:
            # Locks the counter's row (SQLite: the database) before anything is read.
            conn.execute(sa.update(counters).where(this).values(kind=counters.c.kind))
            found = conn.execute(self._info.where(this)).first()
            if found is None:
                return None
            info = _info(found)
            if reset:
                check_reset(info)
            generations = [
                int(generation)
                for (generation,) in conn.execute(
                    sa.select(flushed.c.generation).where(
                        flushed.c.name == name, flushed.c.generation != RETIRED
                    )
                )
            ]
            for table in (self.keys_table, flushed, self.maxima_table, self.shards_table):
                conn.execute(sa.delete(table).where(table.c.name == name))
            conn.execute(sa.delete(counters).where(this))
            if reset:
                self._insert_counter(conn, {"name": name, "kind": info.kind, "shards": info.shards})
            return Deleted(info, generations)

        verb = "resetting" if reset else "deleting"
        return (yield from call(Sql.transaction, f"{verb} counter {name!r}", work))

    @rule
    def counter(self, name: str) -> Program[CounterInfo | None]:
        """See ``Store.counter``."""
        statement = self._info.where(self.counters_table.c.name == name)
        rows = yield from call(Sql.read, f"reading counter {name!r}", statement)
        return _info(rows[0]) if rows else None

    @rule
    def counters(self) -> Program[list[CounterInfo]]:
        """See ``Store.counters``."""
        statement = self._info.order_by(self.counters_table.c.name)
        rows = yield from call(Sql.read, "listing counters", statement)
        return [_info(row) for row in rows]

    # -- writes ------------------------------------------------------------------------

    @rule
    def add(self, name: str, shard: int, delta: int, key: str | None = None) -> Program[bool]:
        """See ``Store.add``."""
        applied = yield from SqlCore.add_many.program(self, name, shard, [(delta, key)])
        return applied[0]

    @rule
    def add_many(
        self, name: str, shard: int, writes: Sequence[tuple[int, str | None]]
    ) -> Program[list[bool]]:
        """See ``Store.add_many``."""
        unkeyed = self._unkeyed(name, shard, writes)
        if unkeyed is None:
            return (yield from self._add_keyed(name, shard, writes))
        yield from call(Sql.fast_add, unkeyed)
        return [True] * len(writes)

    def _add_keyed(
        self, name: str, shard: int, writes: Sequence[tuple[int, str | None]]
    ) -> Program[list[bool]]:
        """``add_many`` of ``writes`` of which some have keys: one transaction recording
        the keys new to the store and adding the writes they guard, and those without."""
        keyed = [key for _, key in writes if key is not None]

        def work(conn: Connection) -> list[bool]:
            created_at = time.time()
            new = {
                key
                for key in dict.fromkeys(keyed)
                if self.dialect.insert_ignore(
                    conn, self.keys_table, {"name": name, "key": key, "created_at": created_at}
                )
            }
            applied = []
            for _, key in writes:
                applied.append(key is None or key in new)
                new.discard(key)  # a key repeated in ``writes`` applies once, first
            deltas = [delta for (delta, _), ok in zip(writes, applied, strict=True) if ok]
            if deltas:
                conn.execute(self._upsert_add, self._add_params(name, shard, deltas))
            return applied

        return (yield from call(Sql.transaction, f"adding to counter {name!r}", work))

    @staticmethod
    def _add_params(name: str, shard: int, deltas: Sequence[int]) -> dict[str, Any]:
        return {"p_name": name, "p_shard": shard, "p_value": sum(deltas)}

    def _unkeyed(
        self, name: str, shard: int, writes: Sequence[tuple[int, str | None]]
    ) -> dict[str, Any] | None:
        """The parameters of the one upsert that makes ``writes`` when none has a key
        (None when one has). ``InvalidDelta`` if their sum could leave signed 64-bit."""
        deltas = []
        keyed = False
        for delta, key in writes:
            deltas.append(delta)
            keyed = keyed or key is not None
        if not sums_fit(deltas):
            raise InvalidDelta(f"{len(writes)} deltas could sum outside signed 64-bit")
        return None if keyed else self._add_params(name, shard, deltas)

    # -- reads -------------------------------------------------------------------------

    @rule
    def total(self, name: str) -> Program[int]:
        """See ``Store.total``."""
        return (yield from SqlCore.totals.program(self, [name]))[name]

    @rule
    def totals(self, names: Iterable[str]) -> Program[dict[str, int]]:
        """See ``Store.totals``."""
        if not (result := dict.fromkeys(names, 0)):
            return result
        wanted = list(result)
        shards, flushed, marks = self.shards_table, self.flushed_table, self.marks_table
        counters = self.counters_table
        high, low, scale = self.dialect.exact_sum(shards.c.value)
        net_high, net_low, _ = self.dialect.exact_sum(flushed.c.up - flushed.c.down)
        mark_high, mark_low, _ = self.dialect.exact_sum(marks.c.mark)
        allocator = sa.and_(counters.c.name == marks.c.name, counters.c.kind == IDS)
        rows = yield from call(
            Sql.read,
            "reading counter values",
            sa.union_all(
                sa.select(shards.c.name, high, low)
                .where(shards.c.name.in_(wanted))
                .group_by(shards.c.name),
                sa.select(flushed.c.name, net_high, net_low)
                .where(flushed.c.name.in_(wanted))
                .group_by(flushed.c.name),
                sa.select(marks.c.name, mark_high, mark_low)
                .join(counters, allocator)
                .where(marks.c.name.in_(wanted))
                .group_by(marks.c.name),
            ),
        )
        for name, high_sum, low_sum in rows:
            result[name] += int(high_sum) * scale + int(low_sum)
        return result

    # -- buffered counters' generations ------------------------------------------------

    @rule
    def add_generation(self, name: str, generation: int) -> Program[None]:
        """See ``Store.add_generation``."""
        row = {"name": name, "generation": generation, "up": 0, "down": 0}
        yield from call(
            Sql.transaction,
            f"recording a generation of counter {name!r}",
            lambda conn: self.dialect.insert_ignore(
                conn, self.flushed_table, {**row, "created_at": time.time()}
            ),
        )

    @rule
    def generations(self, names: Iterable[str]) -> Program[dict[str, dict[int, Flushed]]]:
        """See ``Store.generations``."""
        wanted = list(dict.fromkeys(names))
        if not wanted:
            return {}
        table = self.flushed_table
        rows = yield from call(
            Sql.read,
            "reading flushed generations",
            sa.select(table.c.name, table.c.generation, table.c.up, table.c.down).where(
                table.c.name.in_(wanted)
            ),
        )
        result: dict[str, dict[int, Flushed]] = {}
        for row in rows:
            result.setdefault(row.name, {})[int(row.generation)] = Flushed(
                int(row.up), int(row.down)
            )
        return result

    @rule
    def recorded_at(self, name: str, generations: Iterable[int]) -> Program[dict[int, float]]:
        """See ``Store.recorded_at``."""
        table = self.flushed_table
        statement = sa.select(table.c.generation, table.c.created_at).where(
            table.c.name == name, table.c.generation.in_(list(generations))
        )
        rows = yield from call(Sql.read, f"reading the generations of counter {name!r}", statement)
        return {int(row.generation): float(row.created_at) for row in rows}

    @rule
    def advance(self, name: str, generation: int, seen: Flushed, to: Flushed) -> Program[bool]:
        """See ``Store.advance``."""
        table = self.flushed_table
        statement = (
            sa.update(table)
            .where(
                table.c.name == name,
                table.c.generation == generation,
                table.c.up == seen.up,
                table.c.down == seen.down,
            )
            .values(up=to.up, down=to.down)
        )

        def work(conn: Connection) -> bool:
            return bool(conn.execute(statement).rowcount == 1)

        return (yield from call(Sql.transaction, f"flushing counter {name!r}", work))

    @rule
    def retire(self, name: str, generation: int, applied: Flushed) -> Program[bool]:
        """See ``Store.retire``."""
        table = self.flushed_table
        statement = sa.delete(table).where(
            table.c.name == name,
            table.c.generation == generation,
            table.c.up == applied.up,
            table.c.down == applied.down,
        )
        folded = {
            "p_name": name,
            "p_generation": RETIRED,
            "p_up": applied.up,
            "p_down": applied.down,
            "p_created_at": time.time(),
        }

        def work(conn: Connection) -> bool:
            if conn.execute(statement).rowcount != 1:
                return False
            conn.execute(self._fold, folded)
            return True

        return (
            yield from call(Sql.transaction, f"retiring a generation of counter {name!r}", work)
        )

    # -- monotonic counters' maxima ----------------------------------------------------

    @rule
    def raise_max(self, counter: CounterInfo, shard: int, value: int) -> Program[None]:
        """See ``Store.raise_max``."""
        params = {"p_name": counter.name, "p_incarnation": counter.incarnation}
        params.update(p_shard=shard, p_value=value)
        yield from call(
            Sql.transaction,
            f"persisting the maximum of counter {counter.name!r}",
            lambda conn: conn.execute(self._raise_max, params),
        )

    @rule
    def maxima(self, names: Iterable[str]) -> Program[dict[str, int]]:
        """See ``Store.maxima``."""
        if not (result := dict.fromkeys(names, 0)):
            return result
        table, counters = self.maxima_table, self.counters_table
        rows = yield from call(
            Sql.read,
            "reading counter maxima",
            sa.select(table.c.name, sa.func.max(table.c.value))
            .join(
                counters,
                sa.and_(
                    counters.c.name == table.c.name,
                    counters.c.incarnation == table.c.incarnation,
                ),
            )
            .where(table.c.name.in_(list(result)))
            .group_by(table.c.name),
        )
        result.update({name: int(value) for name, value in rows})
        return result

    # -- id allocators -----------------------------------------------------------------

    @rule
    def reserve(self, name: str, count: int) -> Program[int]:
        """See ``Store.reserve``."""
        table = self.marks_table
        params = {"p_name": name, "p_mark": count}
        if self.dialect.is_mysql:  # no RETURNING: read the row back under the upsert's lock
            mark = sa.select(table.c.mark).where(table.c.name == name)

            def work(conn: Connection) -> int:
                conn.execute(self._reserve_block, params)
                return int(conn.execute(mark).scalar_one())

        else:
            returning = self._reserve_block.returning(table.c.mark)

            def work(conn: Connection) -> int:
                return int(conn.execute(returning, params).scalar_one())

        return (yield from call(Sql.transaction, f"reserving ids of {name!r}", work))

    # -- maintenance -------------------------------------------------------------------

    @rule
    def purge_keys(self, older_than: float) -> Program[int]:
        """See ``Store.purge_keys``."""
        table = self.keys_table
        statement = sa.delete(table).where(table.c.created_at < older_than)
        return (
            yield from call(
                Sql.transaction,
                "purging idempotency keys",
                lambda conn: int(conn.execute(statement).rowcount),
            )
        )


def _info(row: Any) -> CounterInfo:
    return CounterInfo(row.name, row.kind, int(row.shards), int(row.incarnation))


def new_incarnation() -> int:
    """A counter's incarnation: drawn at random (63 bits), so a name's incarnations never
    meet, whatever was deleted."""
    return secrets.randbits(63)


def committing(action: str) -> str:
    """What a store was doing when the ``COMMIT`` of a transaction doing ``action``
    failed, for its error's message."""
    return f"committing ({action})"


__all__ = ["Sql", "SqlCore", "committing"]
