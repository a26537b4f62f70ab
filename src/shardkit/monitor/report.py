"""What the dashboard shows, read from a kit: counters and mapping jobs as JSON-ready
dicts, and the two actions it can take (cancel, resume) behind a token. Independent of
any web framework: ``shardkit.monitor.asgi`` and the Django app serve it."""

from __future__ import annotations

import functools
import hmac
import time
from dataclasses import asdict, dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from shardkit.errors import JobNotFound, ShardkitError, ValidationError
from shardkit.mapper.keys import Key
from shardkit.validation import check_job_id

if TYPE_CHECKING:
    from shardkit.kit import Kit

MAX_COUNTERS = 1000
"""The most counters one listing returns."""
MAX_RANGES = 5000
"""The most ranges of a job's tree one read returns."""
PAGE_HEADERS = {
    # The page runs its own inline script only, reads only its own API, and is never
    # framed by another site.
    "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; img-src data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
"""Headers to serve ``Monitor.page()`` with."""


@dataclass(frozen=True)
class CounterView:
    """A counter as the dashboard shows it. ``value`` is exact now (a sharded counter's
    rows summed; a buffered counter's stored plus pending; an id allocator's high-water
    mark; a monotonic counter's cached value); ``cached`` is what a sharded counter's
    ``value()`` returns now (its cached value; None for the other kinds); ``pending`` a
    buffered counter's increments not yet flushed."""

    name: str
    kind: str
    shards: int
    value: int
    cached: int | None = None
    pending: int | None = None


def counter_views(
    kit: Kit, *, names: list[str] | None = None, prefix: str = "", limit: int = 200
) -> list[CounterView]:
    """The counters named ``names`` (every counter if None) whose names start with
    ``prefix``, the first ``limit`` by name: one store listing, then one read per kind
    (and one per monotonic counter, whose value lives in the cache)."""
    wanted = None if names is None else set(names)
    infos = [
        info
        for info in kit.counters()
        if info.name.startswith(prefix) and (wanted is None or info.name in wanted)
    ][:limit]
    of_kind: dict[str, list[str]] = {}
    for info in infos:
        of_kind.setdefault(info.kind, []).append(info.name)
    exact = kit.values(of_kind.get("sharded", []) + of_kind.get("ids", []), fresh=True)
    sharded = of_kind.get("sharded", [])
    cached = kit.values(sharded)
    parts = kit.parts(of_kind.get("buffered", []))
    views = []
    for info in infos:
        if info.kind == "buffered":
            view = CounterView(
                info.name,
                info.kind,
                info.shards,
                parts[info.name].total,
                None,
                parts[info.name].pending,
            )
        elif info.kind == "monotonic":
            value = kit.monotonic(info.name).value()
            view = CounterView(info.name, info.kind, info.shards, value)
        else:
            view = CounterView(
                info.name, info.kind, info.shards, exact[info.name], cached.get(info.name)
            )
        views.append(view)
    return views


def _key(key: Key | None) -> str | None:
    """A range bound as text (None: unbounded)."""
    if key is None:
        return None
    if isinstance(key, tuple):
        return "(" + ", ".join(_key(part) or "" for part in key) + ")"
    return key.hex() if isinstance(key, bytes) else str(key)


class Monitor:
    """The dashboard's reads and actions on ``kit``, framework-free: each method returns
    ``(HTTP status, JSON-ready body)``. Read-only unless ``token`` is set; then cancel and
    resume take it as ``Authorization: Bearer <token>``."""

    def __init__(self, kit: Kit, *, token: str | None = None, refresh: float = 1.0) -> None:
        if token is not None and len(token) < 16:
            raise ValidationError("the dashboard's token must be at least 16 characters")
        if not 0.1 <= refresh <= 3600:
            raise ValidationError(f"refresh must be 0.1 … 3600 seconds, not {refresh!r}")
        self.kit = kit
        self._token = token
        self.refresh = refresh

    @staticmethod
    @functools.cache
    def page() -> str:
        """The dashboard's HTML page (it reads everything else from the JSON API)."""
        return resources.files("shardkit.monitor").joinpath("page.html").read_text("utf-8")

    def info(self) -> tuple[int, dict[str, Any]]:
        kit = self.kit
        return 200, {
            "store": kit.store.url,
            "cache": kit.cache.url,
            "shared_cache": kit.cache.shared,
            "writable": self._token is not None,
            "refresh": self.refresh,
        }

    def counters(self, prefix: str = "", limit: str | int = 200) -> tuple[int, Any]:
        try:
            count = int(limit)
        except ValueError:
            return 400, {"error": f"limit must be an integer, not {limit!r}"}
        if not 1 <= count <= MAX_COUNTERS:
            return 400, {"error": f"limit must be 1 … {MAX_COUNTERS}"}
        views = counter_views(self.kit, prefix=prefix, limit=count)
        return 200, {"counters": [asdict(view) for view in views]}

    def jobs(self) -> tuple[int, Any]:
        now = time.time()
        return 200, {"jobs": [_job(status, now) for status in self.kit.jobs()[:100]]}

    def job(self, job_id: str) -> tuple[int, Any]:
        try:
            job = self.kit.job(check_job_id(job_id))
            status = job.status()
            ranges = job.ranges(MAX_RANGES)
        except (JobNotFound, ValidationError) as exc:
            return 404, {"error": str(exc)}
        # Siblings in their keys' order (Python's: a job's keys are of one type), so that
        # the tree is drawn left to right; the unbounded lowest range first.
        ranges.sort(
            key=lambda r: (
                r.depth,
                r.range.lo is not None,
                r.range.lo if r.range.lo is not None else 0,
            )
        )
        return 200, {
            "job": _job(status, time.time()),
            "ranges": [
                {
                    "id": r.id,
                    "parent": r.parent,
                    "lo": _key(r.range.lo),
                    "hi": _key(r.range.hi),
                    "state": r.state,
                    "depth": r.depth,
                    "rows": r.rows,
                    "pages": r.pages,
                    "failures": r.failures,
                    "runs": r.runs,
                    "error": r.error,
                }
                for r in ranges
            ],
            "truncated": len(ranges) == MAX_RANGES,
        }

    def act(self, job_id: str, action: str, authorization: str | None) -> tuple[int, Any]:
        """Cancel or resume a job, given the token."""
        if self._token is None:
            return 403, {"error": "the dashboard is read-only: no token is configured"}
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            return 401, {"error": "a valid token is needed (Authorization: Bearer <token>)"}
        if action not in ("cancel", "resume"):
            return 404, {"error": f"no action {action!r}"}
        try:
            job = self.kit.job(check_job_id(job_id))
            done = job.cancel() if action == "cancel" else job.resume()
        except (JobNotFound, ValidationError) as exc:
            return 404, {"error": str(exc)}
        except ShardkitError as exc:
            return 409, {"error": str(exc)}
        return 200, {"job": job_id, "action": action, "result": done}


def _or_zero(key: Key | None) -> Key:
    return 0 if key is None else key


def _job(status: Any, now: float) -> dict[str, Any]:
    ended = status.finished_at or now
    seconds = max(ended - status.created_at, 1e-9)
    return {**asdict(status), "rows_per_second": status.rows / seconds}
