"""The mapping jobs' commands: ``jobs`` and its ``status``, ``watch``, ``cancel``,
``purge``, ``resume``."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import click

import shardkit

from .base import (
    Context,
    emit,
    json_option,
    main,
    out,
    pass_context,
    shown,
)

if TYPE_CHECKING:
    from rich.text import Text


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
    "depth", "pages", "failures", "taken_over", "created_at", "finished_at", "error"}
    (times in seconds since the epoch)."""
    if ctx.invoked_subcommand is not None:
        return
    kit = ctx.ensure_object(Context).reader
    every = kit.jobs()
    statuses = every[:limit]
    if as_json:
        for status in statuses:
            emit(_job_json(status))
        return
    if not statuses:
        out.print("no jobs")
        return
    from rich.table import Column, Table

    short = _short_ids(status.id for status in every)
    table = Table(
        "id",
        "state",
        Column("rows", justify="right"),
        Column("of about", justify="right"),
        Column("ranges left", justify="right"),
        "started",
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
    out.listing(table)


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
        emit(_job_json(status))
        return
    elapsed = (status.finished_at or time.time()) - status.created_at
    lines = [
        f"job      {shown(status.id)}",
        f"state    {status.state}",
        f"rows     {status.rows:,}"
        + ("" if status.estimate is None else f" of about {status.estimate:,}"),
        f"ranges   {status.pending:,} pending, {status.done:,} done, depth {status.depth}",
        f"pages    {status.pages:,}",
        f"retries  {status.failures:,} failed attempts, {status.taken_over:,} ranges taken over",
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
