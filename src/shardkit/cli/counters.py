"""The counters' commands: ``incr``, ``get``, ``grow``, ``delete``, ``reset``, ``ids``,
``flush``, ``worker``, ``list``, ``purge-keys``."""

from __future__ import annotations

import time
from typing import Any, Literal

import click

import shardkit
from shardkit.store.base import check_reset
from shardkit.validation import check_name

# Deliberately the same list as serve.py's: each module uses every one of these.
from .base import (
    Context,
    emit,
    error_line,
    json_option,
    main,
    out,
    pass_context,
    shown,
    stopped_by_sigterm,
)


class ShardCount(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.2
    """A shard count: a whole number, or ``auto``."""

    name = "N|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | Literal["auto"]:
        if value == "auto":
            return "auto"
        try:
            return int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a whole number nor auto", param, ctx)


@main.command()
@click.argument("name")
@click.option("--by", "delta", type=int, default=1, show_default=True, help="Delta (may be < 0).")
@click.option(
    "--key",
    help="Idempotency key (sharded and buffered counters): a repeated call with the same "
    "key applies once.",
)
@click.option(
    "--shards",
    type=ShardCount(),
    help="Shard count for a new counter (grows an existing one); a sharded counter's "
    "default, auto, starts at 1 and grows when writers wait for each other.",
)
@click.option("--buffered", is_flag=True, help="NAME is (or is created) buffered.")
@click.option("--monotonic", is_flag=True, help="NAME is (or is created) monotonic.")
@json_option
@pass_context
def incr(
    context: Context,
    name: str,
    delta: int,
    key: str | None,
    shards: int | Literal["auto"] | None,
    buffered: bool,
    monotonic: bool,
    as_json: bool,
) -> None:
    """Add to counter NAME, creating it (sharded, unless --buffered or --monotonic) if
    needed. A kind flag that does not match an existing counter is refused.

    --json: {"name", "kind", "delta", "applied"} and, for a monotonic counter, "value"."""
    if buffered and monotonic:
        raise click.UsageError("--buffered and --monotonic exclude each other")
    asked = "buffered" if buffered else "monotonic" if monotonic else None
    kit = context.kit
    info = kit.store.counter(check_name(name))
    if info is not None and asked is not None and info.kind != asked:
        raise shardkit.CounterKindMismatch(f"{name!r} is a {info.kind} counter, not {asked}")
    kind = info.kind if info else asked or "sharded"
    if kind == "monotonic" and key is not None:
        raise shardkit.ValidationError("--key is for sharded and buffered counters")
    result: dict[str, Any] = {"name": name, "kind": kind, "delta": delta, "applied": True}
    if kind == "buffered":
        if shards is not None:
            raise shardkit.ValidationError("--shards is for sharded and monotonic counters")
        result["applied"] = kit.buffered(name).incr(delta, key=key)
        said = f"{name} {delta:+d} (pending until flushed)"
    elif kind == "monotonic":
        if shards == "auto":
            raise shardkit.ValidationError("--shards auto is for sharded counters")
        result["value"] = kit.monotonic(name, shards).incr(delta)
        said = f"{name} = {result['value']}"
    else:
        result["applied"] = kit.sharded(name, shards).incr(delta, key=key)
        said = f"{name} {delta:+d}"
    if not result["applied"]:
        said = f"{name}: key {key!r} was applied already; nothing changed"
    if as_json:
        emit(result)
    else:
        out.print(shown(said))


def _reading(counter: shardkit.ShardedCounter | Any, fresh: bool) -> dict[str, Any]:
    """What ``get --json`` prints of ``counter``."""
    found: dict[str, Any] = {"name": counter.name, "kind": counter.kind}
    if isinstance(counter, shardkit.BufferedCounter):
        parts = counter.parts()
        found.update(value=parts.total, stored=parts.stored, pending=parts.pending)
    elif isinstance(counter, shardkit.MonotonicCounter):
        found.update(value=counter.value(), persisted=counter.persisted())
    elif isinstance(counter, shardkit.IdAllocator):
        found.update(reserved=counter.reserved())
    else:
        found.update(value=counter.value(fresh=fresh), shards=counter.shards)
    return found


@main.command()
@click.argument("name")
@click.option("--fresh", is_flag=True, help="Exact sum of the shard rows, bypassing the cache.")
@json_option
@pass_context
def get(context: Context, name: str, fresh: bool, as_json: bool) -> None:
    """Print the value of counter NAME (a buffered one's with its stored and pending parts).

    --json: {"name", "kind", "value"} with "shards" (sharded), "stored" and "pending"
    (buffered), "persisted" (monotonic); an id allocator's is {"name", "kind",
    "reserved"}."""
    found = _reading(context.reader.get(name), fresh)
    if as_json:
        emit(found)
    elif found["kind"] == "buffered":
        out.print(f"{found['value']} (stored {found['stored']}, pending {found['pending']})")
    elif found["kind"] == "monotonic":
        out.print(f"{found['value']} (persisted {found['persisted']})")
    elif found["kind"] == "ids":
        out.print(f"{found['reserved']} (ids reserved up to here)")
    else:
        out.print(str(found["value"]))


@main.command()
@click.argument("name")
@click.argument("shards", type=int)
@json_option
@pass_context
def grow(context: Context, name: str, shards: int, as_json: bool) -> None:
    """Raise the shard count of sharded counter NAME to SHARDS (never lowers it: a
    smaller SHARDS keeps the count it has, and says so).

    --json: {"name", "before", "shards"}."""
    counter = context.reader.get(name)
    if not isinstance(counter, shardkit.ShardedCounter):
        raise shardkit.CounterKindMismatch(f"{name!r} is a {counter.kind} counter, not sharded")
    before = counter.shards
    now = counter.grow(shards)
    if as_json:
        emit({"name": name, "before": before, "shards": now})
    elif now > before:
        out.print(shown(f"{name}: {now} shards"))
    else:
        out.print(shown(f"{name}: kept {now} shards (a shard count never shrinks)"))


def _ending(verb: str, reset: bool, doc: str) -> None:
    """Define the command ``verb`` (``delete`` or ``reset``): refuse what may not be
    ended so (an id allocator's reset), ask (unless --yes), then end the counter."""

    @main.command(verb, help=doc)
    @click.argument("name")
    @click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
    @json_option
    @pass_context
    def end(context: Context, name: str, yes: bool, as_json: bool) -> None:
        kit = context.reader
        info = kit.store.counter(check_name(name))
        if info is None:
            raise shardkit.CounterNotFound(f"no counter named {name!r} in {kit.store.url}")
        if reset:
            check_reset(info)  # refused before asking
        if not yes:
            question = f"{verb.capitalize()} {info.kind} counter {shown(name)}?"
            click.confirm(question, abort=True, err=True)
        ended = kit.reset(name) if reset else kit.delete(name)
        done = "reset" if reset else "deleted"
        if as_json:
            emit({"name": name, "kind": ended.kind, "shards": ended.shards, done: True})
        else:
            out.print(shown(f"{name}: {done} ({ended.kind})"))


_ending(
    "delete",
    False,
    """Delete counter NAME: its value, pending increments, cached values and
    idempotency keys. Asks first, unless --yes. An id allocator's next incarnation
    starts above every id it reserved.

    --json: {"name", "kind", "shards", "deleted": true}.""",
)
_ending(
    "reset",
    True,
    """Reset counter NAME to 0 (to nothing, a monotonic counter): the same kind and
    shards, none of its value, pending increments, cached values or idempotency keys.
    Asks first, unless --yes. An id allocator is never reset (delete it).

    --json: {"name", "kind", "shards", "reset": true}.""",
)


@main.command()
@click.argument("name")
@click.option("--count", type=click.IntRange(1, 1_000_000), default=1, show_default=True)
@click.option("--block", type=int, default=1000, show_default=True, help="Ids reserved at once.")
@json_option
@pass_context
def ids(context: Context, name: str, count: int, block: int, as_json: bool) -> None:
    """Print COUNT new ids of id allocator NAME (created if new), one per line, in
    increasing order: taken from the allocator's block at once (one sub-block of COUNT),
    so the command leaves no hole.

    --json: {"name", "ids"}."""
    taken = context.kit.ids(name, block, sub_block=count).take(count)
    if as_json:
        emit({"name": name, "ids": taken})
    else:
        click.echo("\n".join(map(str, taken)))


@main.command()
@click.argument("name", required=False)
@click.option("--all", "every", is_flag=True, help="Flush every buffered counter.")
@json_option
@pass_context
def flush(context: Context, name: str | None, every: bool, as_json: bool) -> None:
    """Move the pending increments of buffered counter NAME (or --all) into the store.

    --json: {"moved": {name: amount}} (with --all, the counters that moved something)."""
    if every == (name is not None):
        raise click.UsageError("give a counter NAME or --all")
    kit = context.reader
    if name is not None:
        counter = kit.get(name)
        if not isinstance(counter, shardkit.BufferedCounter):
            raise shardkit.CounterKindMismatch(f"{name!r} is a {counter.kind} counter: no flush")
        amount = counter.flush()
        if as_json:
            emit({"moved": {name: amount}})
        else:
            out.print(shown(f"{name} {amount:+d}" if amount else f"{name}: nothing pending"))
        return
    try:
        moved = kit.flush_all()
    except shardkit.FlushFailed as exc:
        _print_moved(exc.moved, as_json)
        raise
    _print_moved(moved, as_json)


def _print_moved(moved: dict[str, int], as_json: bool = False) -> None:
    """The counters that ``flush_all`` moved something of, and how much."""
    flushed = {name: amount for name, amount in moved.items() if amount}
    if as_json:
        emit({"moved": flushed})
        return
    for name, amount in sorted(flushed.items()):
        out.print(shown(f"{name} {amount:+d}"))
    out.print(f"flushed {len(flushed)} counter{'s' if len(flushed) != 1 else ''}")


@main.command()
@click.option(
    "--interval",
    type=click.FloatRange(0.01),
    default=5.0,
    show_default=True,
    help="Seconds between two flushes of every buffered counter.",
)
@click.option("--once", is_flag=True, help="Flush once and exit.")
@pass_context
def worker(context: Context, interval: float, once: bool) -> None:
    """Flush every buffered counter every --interval seconds, in the foreground (Ctrl-C,
    or SIGTERM from a process manager, stops it between two flushes' statements). For
    deployments without Celery: it also picks up flushes that a crashed process had
    scheduled."""
    kit = context.kit
    with stopped_by_sigterm():
        _flush_rounds(kit, interval, once)


def _flush_rounds(kit: shardkit.Kit, interval: float, once: bool) -> None:
    try:
        while True:
            started = time.monotonic()
            try:
                moved = kit.flush_all()
            except shardkit.FlushFailed as exc:
                if once:
                    _print_moved(exc.moved)
                    raise
                moved = exc.moved  # the failed ones are retried on the next round
                error_line(str(exc))
            if once:
                _print_moved(moved)
                return
            for name, amount in sorted(moved.items()):
                if amount:
                    out.print(shown(f"{time.strftime('%H:%M:%S')} {name} {amount:+d}"))
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        out.print("stopped")


@main.command("list")
@json_option
@pass_context
def list_counters(context: Context, as_json: bool) -> None:
    """List every counter with its kind, shard count and exact value.

    --json: a line {"name", "kind", "shards", "value"} per counter."""
    kit = context.reader
    counters = kit.counters()
    values = kit.values([c.name for c in counters if c.kind != "monotonic"], fresh=True)
    rows: list[dict[str, Any]] = [
        {
            "name": info.name,
            "kind": info.kind,
            "shards": info.shards,
            # A monotonic counter's value lives in the cache.
            "value": (
                kit.monotonic(info.name).value() if info.kind == "monotonic" else values[info.name]
            ),
        }
        for info in counters
    ]
    if as_json:
        for row in rows:
            emit(row)
        return
    if not rows:
        out.print(shown(f"no counters in {kit.store.url}"))
        return
    from rich.table import Column, Table

    out.print(shown(f"counters in {kit.store.url}"))
    table = Table(
        "name",
        "kind",
        Column("shards", justify="right"),
        Column("value", justify="right"),
    )
    for row in rows:
        table.add_row(shown(row["name"]), row["kind"], str(row["shards"]), str(row["value"]))
    out.listing(table)


@main.command("purge-keys")
@pass_context
def purge_keys(context: Context) -> None:
    """Delete idempotency keys older than the retention period."""
    out.print(f"purged {context.reader.purge_keys()} idempotency keys")
