"""A job's progress as a Rich progress bar, for the command line and the demo."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from shardkit.mapper.job import Job
from shardkit.mapper.ledger import JobStatus


def watch(job: Job, console: Console, *, poll: float = 0.25) -> JobStatus:
    """Show ``job``'s progress until it finishes (complete, failed or cancelled): rows
    done against the estimate, rows per second, ranges in flight. Returns the last
    status; interrupting the watch leaves the job running."""
    status = job.status()
    progress = Progress(  # fits 80 columns with a job of millions of rows
        BarColumn(bar_width=10),
        TaskProgressColumn(),
        TextColumn(
            "{task.fields[rows]} rows · {task.fields[rate]:,.0f}/s · "
            "{task.fields[pending]} in flight · depth {task.fields[depth]}"
        ),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        bar = progress.add_task(job.id[:12], total=None, rows="0", rate=0.0, pending=0, depth=0)
        last_rows, last_at = status.rows, time.monotonic()
        rate = 0.0
        while True:
            now = time.monotonic()
            if now > last_at:
                # An exponential average: rows/s over the last second or so.
                rate = 0.5 * rate + 0.5 * (status.rows - last_rows) / (now - last_at)
            last_rows, last_at = status.rows, now
            total = max(status.estimate or 0, status.rows) or None
            progress.update(
                bar,
                completed=status.rows,
                total=total,
                rows=f"{status.rows:,}" + ("" if total is None else f"/{total:,}"),
                rate=rate,
                pending=status.pending,
                depth=status.depth,
            )
            if status.finished:
                return status
            time.sleep(poll)
            status = job.status()


__all__ = ["watch"]
