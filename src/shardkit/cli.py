"""The ``shardkit`` command: parses, calls the public API, renders with Rich."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Column, Table

import shardkit
from shardkit.validation import check_name

F = TypeVar("F", bound=Callable[..., Any])

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


class Context:
    """The global options, and the kit they open (only when a command needs one)."""

    def __init__(self, store: str | None, cache: str | None, prefix: str) -> None:
        self.store = store
        self.cache = cache
        self.prefix = prefix
        self._kit: shardkit.Kit | None = None
        self._opened = False

    @classmethod
    def on_kit(cls, kit: shardkit.Kit) -> Context:
        """A context whose commands use ``kit`` (an application's; left open)."""
        context = cls(None, None, "")
        context._kit = kit
        return context

    @property
    def kit(self) -> shardkit.Kit:
        if self._kit is None:
            self._kit = shardkit.connect(self.store, self.cache, prefix=self.prefix)
            self._opened = True
        return self._kit

    def close(self) -> None:
        if self._kit is not None and self._opened:
            self._kit.close()


class _Group(click.Group):
    """Turns every ShardkitError into one line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except shardkit.ShardkitError as exc:
            err.print(f"[red]error:[/red] {exc}", markup=True, soft_wrap=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.option("--store", envvar="SHARDKIT_STORE", help="Store URL [default: sqlite:///shardkit.db]")
@click.option("--cache", envvar="SHARDKIT_CACHE", help="Cache URL [default: memory://]")
@click.option("--prefix", default="shardkit_", show_default=True, help="Table name prefix.")
@click.version_option(shardkit.__version__, prog_name="shardkit")
@click.pass_context
def main(ctx: click.Context, store: str | None, cache: str | None, prefix: str) -> None:
    """Hot counters that take far more writes per second than one row can, and parallel
    visits of huge tables."""
    context = Context(store, cache, prefix)
    ctx.obj = context
    ctx.call_on_close(context.close)


pass_context = click.make_pass_decorator(Context)


@main.command()
@click.argument("name")
@click.option("--by", "delta", type=int, default=1, show_default=True, help="Delta (may be < 0).")
@click.option("--key", help="Idempotency key: a repeated call with the same key applies once.")
@click.option("--shards", type=int, help="Shard count for a new counter (grows an existing one).")
@click.option("--buffered", "kind", flag_value="buffered", help="Create NAME buffered if new.")
@click.option("--monotonic", "kind", flag_value="monotonic", help="Create NAME monotonic if new.")
@pass_context
def incr(
    context: Context, name: str, delta: int, key: str | None, shards: int | None, kind: str | None
) -> None:
    """Add to counter NAME, creating it (sharded, unless --buffered or --monotonic) if
    needed."""
    kit = context.kit
    info = kit.store.counter(name)
    kind = info.kind if info else kind or "sharded"
    if kind != "sharded" and key is not None:
        raise shardkit.ValidationError("--key is for sharded counters")
    if kind == "buffered":
        if shards is not None:
            raise shardkit.ValidationError("--shards is for sharded and monotonic counters")
        kit.buffered(name).incr(delta)
        out.print(f"{name} {delta:+d} (pending until flushed)")
    elif kind == "monotonic":
        out.print(f"{name} = {kit.monotonic(name, shards).incr(delta)}")
    elif kit.sharded(name, shards).incr(delta, key=key):
        out.print(f"{name} {delta:+d}")
    else:
        out.print(f"{name}: key {key!r} was applied already; nothing changed")


@main.command()
@click.argument("name")
@click.option("--fresh", is_flag=True, help="Exact sum of the shard rows, bypassing the cache.")
@pass_context
def get(context: Context, name: str, fresh: bool) -> None:
    """Print the value of counter NAME (a buffered one's with its stored and pending parts)."""
    counter = context.kit.get(name)
    if isinstance(counter, shardkit.BufferedCounter):
        parts = counter.parts()
        out.print(f"{parts.total} (stored {parts.stored}, pending {parts.pending})")
    elif isinstance(counter, shardkit.MonotonicCounter):
        out.print(f"{counter.value()} (persisted {counter.persisted()})")
    elif isinstance(counter, shardkit.IdAllocator):
        out.print(f"{counter.reserved()} (ids reserved up to here)")
    else:
        out.print(counter.value(fresh=fresh))


@main.command()
@click.argument("name")
@click.argument("shards", type=int)
@pass_context
def grow(context: Context, name: str, shards: int) -> None:
    """Raise the shard count of sharded counter NAME to SHARDS (never lowers it)."""
    counter = context.kit.get(name)
    if not isinstance(counter, shardkit.ShardedCounter):
        raise shardkit.CounterKindMismatch(f"{name!r} is a {counter.kind} counter, not sharded")
    out.print(f"{name}: {counter.grow(shards)} shards")


@main.command()
@click.argument("name")
@click.option("--count", type=click.IntRange(1, 1_000_000), default=1, show_default=True)
@click.option("--block", type=int, default=1000, show_default=True, help="Ids reserved at once.")
@pass_context
def ids(context: Context, name: str, count: int, block: int) -> None:
    """Print COUNT new ids of id allocator NAME (created if new), one per line."""
    out.print("\n".join(map(str, context.kit.ids(name, block).take(count))))


@main.command()
@click.argument("name", required=False)
@click.option("--all", "every", is_flag=True, help="Flush every buffered counter.")
@pass_context
def flush(context: Context, name: str | None, every: bool) -> None:
    """Move the pending increments of buffered counter NAME (or --all) into the store."""
    if every == (name is not None):
        raise click.UsageError("give a counter NAME or --all")
    kit = context.kit
    if name is not None:
        counter = kit.get(name)
        if not isinstance(counter, shardkit.BufferedCounter):
            raise shardkit.CounterKindMismatch(f"{name!r} is a {counter.kind} counter: no flush")
        moved = {name: counter.flush()}
    else:
        try:
            moved = kit.flush_all()
        except shardkit.FlushFailed as exc:
            _print_moved(exc.moved)
            raise
    _print_moved(moved)


def _print_moved(moved: dict[str, int]) -> None:
    flushed = {name: amount for name, amount in moved.items() if amount}
    for name, amount in sorted(flushed.items()):
        out.print(f"{name} {amount:+d}")
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
    with _stopped_by_sigterm():
        _flush_rounds(kit, interval, once)


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM (systemd, Docker, supervisord stop with it) stops the block as Ctrl-C
    does. (A process started in the background by a shell ignores SIGINT, and so does
    a worker started from it; SIGTERM still reaches it.)"""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can handle signals
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
                err.print(f"[red]error:[/red] {exc}", markup=True, soft_wrap=True)
            if once:
                _print_moved(moved)
                return
            for name, amount in sorted(moved.items()):
                if amount:
                    out.print(f"{time.strftime('%H:%M:%S')} {name} {amount:+d}")
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        out.print("stopped")


@main.command("list")
@pass_context
def list_counters(context: Context) -> None:
    """List every counter with its kind, shard count and exact value."""
    kit = context.kit
    counters = kit.counters()
    values = kit.values([c.name for c in counters if c.kind != "monotonic"], fresh=True)
    table = Table("name", "kind", "shards", "value", title=f"counters in {kit.store.url}")
    for info in counters:
        value = values.get(info.name)
        if value is None:  # a monotonic counter: its value lives in the cache
            value = kit.monotonic(info.name).value()
        table.add_row(info.name, info.kind, str(info.shards), str(value))
    out.print(table)


@main.command("purge-keys")
@pass_context
def purge_keys(context: Context) -> None:
    """Delete idempotency keys older than the retention period."""
    out.print(f"purged {context.kit.purge_keys()} idempotency keys")


@main.group(invoke_without_command=True)
@click.option("--limit", type=click.IntRange(1), default=20, show_default=True)
@click.pass_context
def jobs(ctx: click.Context, limit: int) -> None:
    """List mapping jobs (newest first), or act on one: status, watch, cancel, resume."""
    if ctx.invoked_subcommand is not None:
        return
    statuses = ctx.ensure_object(Context).kit.jobs()[:limit]
    table = Table("state", "rows", "estimate", "pending", "done", "depth", "started")
    table.columns.insert(0, Column("id", no_wrap=True))
    for status in statuses:
        table.add_row(
            status.id,
            _state(status.state),
            f"{status.rows:,}",
            "?" if status.estimate is None else f"{status.estimate:,}",
            str(status.pending),
            str(status.done),
            str(status.depth),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status.created_at)),
        )
    out.print(table if statuses else "no jobs")


def _state(state: str) -> str:
    colour = {"complete": "green", "running": "cyan", "failed": "red"}.get(state, "yellow")
    return f"[{colour}]{state}[/]"


@jobs.command("status")
@click.argument("job_id", metavar="ID")
@pass_context
def job_status(context: Context, job_id: str) -> None:
    """Show job ID's progress from its ledger."""
    status = context.kit.job(job_id).status()
    elapsed = (status.finished_at or time.time()) - status.created_at
    lines = [
        f"job      {status.id}",
        f"state    {_state(status.state)}",
        f"rows     {status.rows:,}"
        + ("" if status.estimate is None else f" of about {status.estimate:,}"),
        f"ranges   {status.pending} pending, {status.done} done, depth {status.depth}",
        f"pages    {status.pages:,}",
        f"elapsed  {elapsed:,.1f} s",
    ]
    if status.error:
        lines.append(f"error    {status.error}")
    out.print("\n".join(lines))


@jobs.command("watch")
@click.argument("job_id", metavar="ID")
@pass_context
def job_watch(context: Context, job_id: str) -> None:
    """Follow job ID with a progress bar until it finishes."""
    from shardkit.mapper.progress import watch

    status = watch(context.kit.job(job_id), out)
    out.print(f"{job_id}: {_state(status.state)}, {status.rows:,} rows")
    if status.state != "complete":
        sys.exit(1)


@jobs.command("cancel")
@click.argument("job_id", metavar="ID")
@pass_context
def job_cancel(context: Context, job_id: str) -> None:
    """Cancel job ID: its pending ranges are no longer picked up."""
    if context.kit.job(job_id).cancel():
        out.print(f"{job_id}: cancelled")
    else:
        out.print(f"{job_id}: already {context.kit.job(job_id).status().state}")


@jobs.command("purge")
@click.option(
    "--age",
    type=float,
    default=7 * 86400.0,
    show_default=True,
    help="Seconds since a job finished.",
)
@pass_context
def job_purge(context: Context, age: float) -> None:
    """Delete jobs complete or cancelled more than AGE seconds ago (failed ones stay)."""
    out.print(f"purged {context.kit.purge_jobs(age)} finished jobs")


@jobs.command("resume")
@click.argument("job_id", metavar="ID")
@pass_context
def job_resume(context: Context, job_id: str) -> None:
    """Run job ID's pending ranges again, here (on a local executor) or on the kit's
    workers, and follow it. Its functions must be importable (or signed, with
    $SHARDKIT_SECRET)."""
    from shardkit.mapper.progress import watch

    job = context.kit.job(job_id)
    out.print(f"{job_id}: {job.resume()} ranges submitted")
    status = watch(job, out)
    out.print(f"{job_id}: {_state(status.state)}, {status.rows:,} rows")
    if status.state != "complete":
        sys.exit(1)


_COUNTER_HELP = "A counter whose value to export as shardkit_counter_value (repeatable)."


@main.command()
@click.option("--port", type=click.IntRange(1, 65535), default=9464, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--counter", "counters", multiple=True, help=_COUNTER_HELP)
@pass_context
def metrics(context: Context, port: int, host: str, counters: tuple[str, ...]) -> None:
    """Serve Prometheus metrics at http://HOST:PORT/metrics until stopped: those of every
    process sharing $PROMETHEUS_MULTIPROC_DIR (web workers, Celery's pool) and, read
    from the store and cache at each scrape, jobs' progress, pending increments and the
    values of the --counter names."""
    from shardkit.monitor.exporter import serve

    for name in counters:
        check_name(name)
    server = serve(context.kit, port, host, counters)
    out.print(f"serving metrics on http://{host}:{server.port}/metrics")
    with _stopped_by_sigterm():
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            out.print("stopped")
        finally:
            server.close()


@main.command()
@click.option("--port", type=click.IntRange(1, 65535), default=8050, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--token",
    envvar="SHARDKIT_DASHBOARD_TOKEN",
    help="Allows cancelling and resuming jobs to whoever gives it ($SHARDKIT_DASHBOARD_TOKEN; "
    "16 characters or more). Without it the dashboard is read-only.",
)
@click.option(
    "--refresh",
    type=click.FloatRange(0.1, 3600),
    default=1.0,
    show_default=True,
    help="Seconds between two updates of the page.",
)
@click.option("--counter", "counters", multiple=True, help=_COUNTER_HELP)
@pass_context
def dashboard(
    context: Context,
    port: int,
    host: str,
    token: str | None,
    refresh: float,
    counters: tuple[str, ...],
) -> None:
    """Serve a live web page of counters and mapping jobs (with /metrics) until stopped."""
    from shardkit.monitor.asgi import dashboard as app

    try:
        import uvicorn
    except ImportError as exc:
        raise shardkit.MissingDriver(
            "serving needs uvicorn: pip install 'shardkit[dashboard]'"
        ) from exc

    for name in counters:
        check_name(name)
    served = app(context.kit, token=token, refresh=refresh, counters=counters)
    out.print(f"dashboard on http://{host}:{port}/ ({'read-write' if token else 'read-only'})")
    uvicorn.run(served, host=host, port=port, log_level="warning")


@main.command()
@click.option("--writers", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--seconds", type=click.FloatRange(0.1, 60), default=3.0, show_default=True)
@pass_context
def demo(context: Context, writers: int, seconds: float) -> None:
    """Race writer processes on one hot counter (a naive single row, sharded, buffered),
    then map over a generated table with a progress bar.

    Runs on a temporary SQLite file unless --store is given.
    """
    from shardkit.demo import run_demo

    if not run_demo(context.store, context.cache, writers=writers, seconds=seconds, console=out):
        err.print("[red]error:[/red] a final total was not exact", markup=True)
        sys.exit(1)
