"""The command line's frame: the ``main`` group and its options, the ``Context`` of a
run (the kit, opened when a command first needs it), and how everything is printed
(lines as they are, Rich for tables; user text never markup)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import unicodedata
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

import shardkit
from shardkit import metrics

if TYPE_CHECKING:
    from rich.table import Table

    from .screen import Screen


class _Output:
    """Lines of text, and a ``Screen`` made when first needed (Rich is imported then, so
    that ``--help`` and a command whose lines go to a file or a pipe do not pay for it):
    user text is never markup; on a terminal, lines are broken at spaces only, and tables
    shown only when they fit; output that is not a terminal is never wrapped or cut."""

    def __init__(self, *, stderr: bool = False) -> None:
        self._stderr = stderr
        self._screen: Screen | None = None

    @property
    def console(self) -> Screen:
        if self._screen is None:
            from .screen import Screen

            self._screen = Screen(stderr=self._stderr, markup=False)
        return self._screen

    def print(self, *objects: Any) -> None:
        """Print ``objects``: lines of text as they are when they do not go to a
        terminal (Rich is not needed for them), anything else through the console."""
        stream = sys.stderr if self._stderr else sys.stdout
        if all(isinstance(each, str) for each in objects) and not stream.isatty():
            click.echo(" ".join(objects), err=self._stderr)
        else:
            self.console.print(*objects)

    def listing(self, table: Table) -> None:
        """Print ``table``, or its rows as blocks if they do not fit (``screen.listing``)."""
        from .screen import listing

        listing(self.console, table)


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


def error_line(message: str) -> None:
    from rich.text import Text

    err.print(Text.assemble(("error:", "red"), " ", shown(message)))


def emit(value: Any) -> None:
    """Print ``value`` as one line of JSON (ASCII: every other character escaped)."""
    click.echo(json.dumps(value, sort_keys=True))


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead.")


class Context:
    """The global options, and the kit they open (only when a command needs one)."""

    def __init__(
        self, store: str | None, cache: str | None, prefix: str, *, metered: bool = True
    ) -> None:
        self.store = store
        self.cache = cache
        self.prefix = prefix
        self.metered = metered
        """Whether the kit records metrics (when they are on: ``shardkit.metrics``)."""
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
            with contextlib.nullcontext() if self.metered else metrics.unread():
                self._kit = shardkit.connect(
                    self.store, self.cache, prefix=self.prefix, create=create
                )
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
            error_line(str(exc))
            sys.exit(1)


@click.group(cls=_Group)
@click.option("--store", envvar="SHARDKIT_STORE", help="Store URL [default: sqlite:///shardkit.db]")
@click.option("--cache", envvar="SHARDKIT_CACHE", help="Cache URL [default: memory://]")
@click.option(
    "--prefix",
    envvar="SHARDKIT_PREFIX",
    default="shardkit_",
    show_default=True,
    help="Table name prefix.",
)
@click.version_option(shardkit.__version__, prog_name="shardkit")
@click.pass_context
def main(ctx: click.Context, store: str | None, cache: str | None, prefix: str) -> None:
    """Hot counters that take far more writes per second than one row can, and parallel
    visits of huge tables.

    Exit status: 0 done, 1 failed (one line on stderr), 2 usage error."""
    # Nothing reads a one-off command's metrics but a multiprocess directory's exporter.
    metered = ctx.invoked_subcommand in _SERVERS or bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    context = Context(store, cache, prefix, metered=metered)
    ctx.obj = context
    ctx.call_on_close(context.close)


pass_context = click.make_pass_decorator(Context)
_SERVERS = ("metrics", "dashboard")  # the commands that serve their process's metrics


@contextlib.contextmanager
def stopped_by_sigterm() -> Iterator[None]:
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
