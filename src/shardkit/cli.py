"""The ``shardkit`` command: parses, calls the public API, renders with Rich.

Exit status: 0 done; 1 failed, with one line on stderr (``error: …``); 2 a usage error,
with Click's message naming the argument or option. Names, keys, URLs, job ids and error
messages are printed as they are, never read as markup; control and formatting
characters show as escapes (``\\x1b``, ``\\u200f``). Output that is not a terminal is
never wrapped or cut. ``--json`` prints a JSON object, or JSON Lines for lists, with the
keys the reference lists. Commands that only read (``get``, ``list``, ``jobs``, …)
create nothing: a missing store or table is an error naming the URL and the prefix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import socket
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import click

import shardkit
from shardkit.validation import check_name

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

F = TypeVar("F", bound=Callable[..., Any])


class _Output:
    """Plain lines, and a Rich console made when first needed (Rich is imported then, so
    that ``--help`` and a command that prints a line do not pay for it): user text is
    never markup, output that is not a terminal is never wrapped or cut."""

    def __init__(self, *, stderr: bool = False) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    @property
    def console(self) -> Console:
        if self._console is None:
            from rich.console import Console

            console = Console(
                stderr=self._stderr, highlight=False, markup=False, emoji=False, soft_wrap=True
            )
            if not console.is_terminal:
                console.width = 1_000_000
            self._console = console
        return self._console

    def print(self, *objects: Any) -> None:
        """Print ``objects``: lines of text as they are (Rich is not needed for them),
        anything else (a table, a progress bar) through the console."""
        if all(isinstance(each, str) for each in objects):
            click.echo(" ".join(objects), err=self._stderr)
        else:
            self.console.print(*objects)


out = _Output()
err = _Output(stderr=True)

# Characters a terminal would act on or hide, instead of showing: controls (escape
# sequences start with one), formatting (bidirectional overrides, zero-width) and
# surrogates, and line and paragraph separators.
_UNSHOWN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def shown(text: str) -> str:
    """``text`` with each character a terminal would act on or hide written as its
    Python escape (``\\x1b``, ``\\u202e``); everything else as it is."""
    return "".join(
        char.encode("unicode_escape").decode("ascii")
        if unicodedata.category(char) in _UNSHOWN
        else char
        for char in text
    )


def _error(message: str) -> None:
    from rich.text import Text

    err.print(Text.assemble(("error:", "red"), " ", shown(message)))


def _emit(value: Any) -> None:
    """Print ``value`` as one line of JSON (ASCII: every other character escaped)."""
    click.echo(json.dumps(value, sort_keys=True))


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead.")


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
        """The kit, its tables created if missing (for commands that write)."""
        return self._open(create=True)

    @property
    def reader(self) -> shardkit.Kit:
        """The kit of a store that exists already (for commands that read, or act on
        what is there): nothing is created; ``StoreNotFound`` if it is missing."""
        return self._open(create=False)

    def _open(self, *, create: bool) -> shardkit.Kit:
        if self._kit is None:
            self._kit = shardkit.connect(self.store, self.cache, prefix=self.prefix, create=create)
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
            _error(str(exc))
            sys.exit(1)


@click.group(cls=_Group)
@click.option("--store", envvar="SHARDKIT_STORE", help="Store URL [default: sqlite:///shardkit.db]")
@click.option("--cache", envvar="SHARDKIT_CACHE", help="Cache URL [default: memory://]")
@click.option("--prefix", default="shardkit_", show_default=True, help="Table name prefix.")
@click.version_option(shardkit.__version__, prog_name="shardkit")
@click.pass_context
def main(ctx: click.Context, store: str | None, cache: str | None, prefix: str) -> None:
    """Hot counters that take far more writes per second than one row can, and parallel
    visits of huge tables.

    Exit status: 0 done, 1 failed (one line on stderr), 2 usage error."""
    context = Context(store, cache, prefix)
    ctx.obj = context
    ctx.call_on_close(context.close)


pass_context = click.make_pass_decorator(Context)


@main.command()
@click.argument("name")
@click.option("--by", "delta", type=int, default=1, show_default=True, help="Delta (may be < 0).")
@click.option("--key", help="Idempotency key: a repeated call with the same key applies once.")
@click.option("--shards", type=int, help="Shard count for a new counter (grows an existing one).")
@click.option("--buffered", is_flag=True, help="NAME is (or is created) buffered.")
@click.option("--monotonic", is_flag=True, help="NAME is (or is created) monotonic.")
@json_option
@pass_context
def incr(
    context: Context,
    name: str,
    delta: int,
    key: str | None,
    shards: int | None,
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
    if kind != "sharded" and key is not None:
        raise shardkit.ValidationError("--key is for sharded counters")
    result: dict[str, Any] = {"name": name, "kind": kind, "delta": delta, "applied": True}
    if kind == "buffered":
        if shards is not None:
            raise shardkit.ValidationError("--shards is for sharded and monotonic counters")
        kit.buffered(name).incr(delta)
        said = f"{name} {delta:+d} (pending until flushed)"
    elif kind == "monotonic":
        result["value"] = kit.monotonic(name, shards).incr(delta)
        said = f"{name} = {result['value']}"
    elif kit.sharded(name, shards).incr(delta, key=key):
        said = f"{name} {delta:+d}"
    else:
        result["applied"] = False
        said = f"{name}: key {key!r} was applied already; nothing changed"
    if as_json:
        _emit(result)
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
        _emit(found)
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
        _emit({"name": name, "before": before, "shards": now})
    elif now > before:
        out.print(shown(f"{name}: {now} shards"))
    else:
        out.print(shown(f"{name}: kept {now} shards (a shard count never shrinks)"))


@main.command()
@click.argument("name")
@click.option("--count", type=click.IntRange(1, 1_000_000), default=1, show_default=True)
@click.option("--block", type=int, default=1000, show_default=True, help="Ids reserved at once.")
@json_option
@pass_context
def ids(context: Context, name: str, count: int, block: int, as_json: bool) -> None:
    """Print COUNT new ids of id allocator NAME (created if new), one per line.

    --json: {"name", "ids"}."""
    taken = context.kit.ids(name, block).take(count)
    if as_json:
        _emit({"name": name, "ids": taken})
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
            _emit({"moved": {name: amount}})
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
        _emit({"moved": flushed})
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
                _error(str(exc))
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
            _emit(row)
        return
    if not rows:
        out.print(shown(f"no counters in {kit.store.url}"))
        return
    from rich.table import Column, Table

    out.print(shown(f"counters in {kit.store.url}"))
    table = Table(
        Column("name", overflow="fold", ratio=1),
        "kind",
        Column("shards", justify="right", no_wrap=True),
        Column("value", justify="right", no_wrap=True),
    )
    for row in rows:
        table.add_row(shown(row["name"]), row["kind"], str(row["shards"]), str(row["value"]))
    out.print(table)


@main.command("purge-keys")
@pass_context
def purge_keys(context: Context) -> None:
    """Delete idempotency keys older than the retention period."""
    out.print(f"purged {context.reader.purge_keys()} idempotency keys")


SHORT_ID = 8  # the fewest characters of a job id shown in the list


def _short_ids(ids: Iterable[str]) -> dict[str, str]:
    """Each id's shortest prefix of at least ``SHORT_ID`` characters that starts no other
    id (git's short hashes): accepted wherever a job ID is."""
    every = list(ids)
    short = {}
    for job_id in every:
        length = SHORT_ID
        while length < len(job_id) and any(
            other != job_id and other.startswith(job_id[:length]) for other in every
        ):
            length += 1
        short[job_id] = job_id[:length]
    return short


def _job(kit: shardkit.Kit, given: str) -> shardkit.Job:
    """The job whose id is ``given``, or starts with it and no other's does (every job
    is read only when ``given`` is no job's whole id)."""
    with contextlib.suppress(shardkit.JobNotFound, shardkit.ValidationError):
        return kit.job(given)
    matches = [status.id for status in kit.jobs() if status.id.startswith(given)]
    if len(matches) == 1:
        return kit.job(matches[0])
    if not matches:
        raise shardkit.JobNotFound(f"no job {given!r} (nor one whose id starts so)")
    listed = ", ".join(repr(job_id) for job_id in matches[:3])
    raise shardkit.ValidationError(
        f"{given!r} starts {len(matches)} job ids ({listed}{', …' if len(matches) > 3 else ''})"
        "; give more of it"
    )


def _job_json(status: shardkit.JobStatus) -> dict[str, Any]:
    return dataclasses.asdict(status)


@main.group(invoke_without_command=True)
@click.option("--limit", type=click.IntRange(1), default=20, show_default=True)
@json_option
@click.pass_context
def jobs(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List mapping jobs (newest first), or act on one: status, watch, cancel, resume.
    A job ID may be given by its start, as the list shows it.

    --json: a line per job: {"id", "state", "rows", "estimate", "pending", "done",
    "depth", "pages", "failures", "created_at", "finished_at", "error"} (times in
    seconds since the epoch)."""
    if ctx.invoked_subcommand is not None:
        return
    kit = ctx.ensure_object(Context).reader
    every = kit.jobs()
    statuses = every[:limit]
    if as_json:
        for status in statuses:
            _emit(_job_json(status))
        return
    if not statuses:
        out.print("no jobs")
        return
    from rich.table import Column, Table

    short = _short_ids(status.id for status in every)
    table = Table(
        Column("id", overflow="fold"),
        "state",
        Column("rows", justify="right", no_wrap=True),
        Column("of about", justify="right", no_wrap=True),
        Column("ranges left", justify="right", no_wrap=True),
        Column("started", no_wrap=True),
    )
    for status in statuses:
        table.add_row(
            shown(short[status.id]),
            _state(status.state),
            f"{status.rows:,}",
            "?" if status.estimate is None else f"{status.estimate:,}",
            f"{status.pending:,}",
            time.strftime("%m-%d %H:%M", time.localtime(status.created_at)),
        )
    out.print(table)


def _state(state: str) -> Text:
    from rich.text import Text

    colour = {"complete": "green", "running": "cyan", "failed": "red"}.get(state, "yellow")
    return Text(state, style=colour)


@jobs.command("status")
@click.argument("job_id", metavar="ID")
@json_option
@pass_context
def job_status(context: Context, job_id: str, as_json: bool) -> None:
    """Show job ID's progress from its ledger.

    --json: the object a line of ``jobs --json`` is."""
    status = _job(context.reader, job_id).status()
    if as_json:
        _emit(_job_json(status))
        return
    elapsed = (status.finished_at or time.time()) - status.created_at
    lines = [
        f"job      {shown(status.id)}",
        f"state    {status.state}",
        f"rows     {status.rows:,}"
        + ("" if status.estimate is None else f" of about {status.estimate:,}"),
        f"ranges   {status.pending:,} pending, {status.done:,} done, depth {status.depth}",
        f"pages    {status.pages:,}",
        f"elapsed  {elapsed:,.1f} s",
    ]
    if status.error:
        lines.append(f"error    {shown(status.error)}")
    out.print("\n".join(lines))


def _followed(job: shardkit.Job) -> None:
    """Follow ``job`` with a progress bar until it finishes; exit 1 unless complete."""
    from rich.text import Text

    from shardkit.mapper.progress import watch

    status = watch(job, out.console)
    out.print(Text.assemble(shown(job.id), ": ", _state(status.state), f", {status.rows:,} rows"))
    if status.state != "complete":
        sys.exit(1)


@jobs.command("watch")
@click.argument("job_id", metavar="ID")
@pass_context
def job_watch(context: Context, job_id: str) -> None:
    """Follow job ID with a progress bar until it finishes (exit 1 unless complete)."""
    _followed(_job(context.reader, job_id))


@jobs.command("cancel")
@click.argument("job_id", metavar="ID")
@pass_context
def job_cancel(context: Context, job_id: str) -> None:
    """Cancel job ID: its pending ranges are no longer picked up."""
    job = _job(context.reader, job_id)
    if job.cancel():
        out.print(shown(f"{job.id}: cancelled"))
    else:
        out.print(shown(f"{job.id}: already {job.status().state}"))


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
    out.print(f"purged {context.reader.purge_jobs(age)} finished jobs")


@jobs.command("resume")
@click.argument("job_id", metavar="ID")
@pass_context
def job_resume(context: Context, job_id: str) -> None:
    """Run job ID's pending ranges again, here (on a local executor) or on the kit's
    workers, and follow it (exit 1 unless it completes). Its functions must be
    importable (or signed, with $SHARDKIT_SECRET)."""
    job = _job(context.reader, job_id)
    out.print(shown(f"{job.id}: {job.resume()} ranges submitted"))
    _followed(job)


def _listening(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port``, or ``ConfigurationError`` saying why not
    (before anything says it serves)."""
    try:
        return socket.create_server((host, port), reuse_port=False)
    except OSError as exc:
        raise shardkit.ConfigurationError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc


_COUNTER_HELP = "A counter whose value to export as shardkit_value (repeatable)."


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
    kit = context.reader
    try:
        server = serve(kit, port, host, counters)
    except OSError as exc:
        raise shardkit.ConfigurationError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc
    out.print(shown(f"serving metrics on http://{host}:{server.port}/metrics"))
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
    served = app(context.reader, token=token, refresh=refresh, counters=counters)
    listening = _listening(host, port)
    mode = "read-write" if token else "read-only"
    out.print(shown(f"dashboard on http://{host}:{port}/ ({mode})"))
    uvicorn.Server(uvicorn.Config(served, log_level="warning")).run(sockets=[listening])


@main.command()
@click.option("--writers", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--seconds", type=click.FloatRange(0.1, 60), default=3.0, show_default=True)
@json_option
@pass_context
def demo(context: Context, writers: int, seconds: float, as_json: bool) -> None:
    """Race writer processes on one hot counter (a naive single row, sharded, buffered),
    then map over a generated table with a progress bar. Exits 1 unless every total is
    exact.

    Runs on a temporary SQLite file unless --store is given.

    --json: {"store", "cache", "seconds", "exact", "races": [{"mode", "writers", "ops",
    "ops_per_second", "counted", "exact"}], "map": {"state", "rows", "pages", "ranges",
    "depth", "exact"}}, printed at the end."""
    from rich.console import Console

    from shardkit.demo import run_demo

    shows = None
    if not as_json:
        # The demo's own text is styled with Rich markup (the URLs in it escaped).
        shows = Console(highlight=False, emoji=False, soft_wrap=True)
        if not shows.is_terminal:
            shows.width = 1_000_000
    result = run_demo(context.store, context.cache, writers=writers, seconds=seconds, console=shows)
    if as_json:
        mapped = result.mapped
        _emit(
            {
                "store": result.store,
                "cache": result.cache,
                "seconds": result.seconds,
                "exact": result.exact,
                "races": [
                    {
                        "mode": race.mode,
                        "writers": race.writers,
                        "ops": race.ops,
                        "ops_per_second": round(race.rate, 1),
                        "counted": race.counted,
                        "exact": race.exact,
                    }
                    for race in result.races
                ],
                "map": {
                    "state": mapped.state,
                    "rows": mapped.rows,
                    "pages": mapped.pages,
                    "ranges": mapped.ranges,
                    "depth": mapped.depth,
                    "exact": mapped.exact,
                },
            }
        )
    if not result.exact:
        _error("a final total was not exact")
        sys.exit(1)
