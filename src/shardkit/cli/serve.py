"""The commands that serve or show: ``metrics``, ``dashboard``, ``demo``."""

from __future__ import annotations

import socket
import sys
import threading

import click

import shardkit
from shardkit.validation import check_name

# Deliberately the same list as counters.py's: each module uses every one of these.
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
    with stopped_by_sigterm():
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
    from shardkit.demo import run_demo

    from .screen import Screen

    # The demo's own text is styled with Rich markup (the URLs in it escaped).
    shows = None if as_json else Screen()
    result = run_demo(
        context.store,
        context.cache,
        writers=writers,
        seconds=seconds,
        console=shows,
        prefix=context.prefix,
    )
    if as_json:
        mapped = result.mapped
        emit(
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
        error_line("a final total was not exact")
        sys.exit(1)
