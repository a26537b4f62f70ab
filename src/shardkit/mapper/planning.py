"""How a range task plans what follows a full page: go on in place, or split what is
left of its range, and where (``Planner``) — from what the database already knows (its
statistics, as ``Statistics``) and a few index probes (``seek``), never by reading the
range."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from shardkit.errors import UnsupportedKey
from shardkit.executor import Executor, LocalExecutor
from shardkit.mapper.keys import Key, KeyRange, ahead, interpolate
from shardkit.mapper.ledger import Child, RangeRow
from shardkit.mapper.source import Source, Statistics
from shardkit.mapper.spec import MapSpec

Children = list[Child]


class Planner:
    """The splitting policy of one mapper's range tasks, for its ``executor``: the
    leaves a job's tree aims at, and the idle workers of a local executor that a range
    splits for (claimed by one run at a time). Thread-safe."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._lock = threading.Lock()
        self._claims: dict[int, int] = {}  # idle workers claimed by a range's run, by thread

    def plan(
        self,
        conn: Connection,
        spec: MapSpec,
        row: RangeRow,
        rows: Sequence[Any],
        after: Key | None,
        stats: Statistics,
    ) -> tuple[Children | None, int | None]:
        """What follows a page: ``[]`` (the range is exhausted), None (go on in place), or
        the children that split what is left of the range; and the rows now planned in
        the range.

        A range goes on in place while what its plan leaves is a leaf's size or less:
        the source's estimated rows over the leaves the tree aims at (``_leaves``), at
        least ``fanout`` pages — unless workers are idle (``_claim``): then it splits what
        its plan leaves into a share for itself and each of them, if each share holds
        ``fanout`` pages. A range with no plan (the root), or past it (more rows
        than planned), estimates what is left from the database's statistics (the
        histogram's bounds past its checkpoint, each bucket an equal share of the rows;
        the root: the row estimate) and from the page it read (as many keys per page past
        it, up to its largest key), taking the larger; then goes on planned at that, or
        splits. The children are cut
        at the histogram's bounds where it has enough of them inside, else at even steps
        of key arithmetic; the database places each cut at a real key (``seek``), so
        neither stale statistics nor a collation can make a partition wrong, only uneven
        — and an uneven child is split again when it passes its plan. Reads for planning:
        the statistics once per job and process, two index probes and ``fanout - 1`` more
        per estimate and split."""
        if len(rows) < spec.page_size:
            return [], row.planned
        if spec.fanout < 2:  # one cursor, never split
            return None, row.planned
        least = spec.fanout * spec.page_size
        leaf = max(least, (stats.rows or 0) // self._leaves(spec))
        done = row.visited + len(rows)
        if row.planned is not None and 0 < row.planned - done <= leaf:
            idle = self._claim(min(spec.fanout - 1, (row.planned - done) // least - 1))
            if not idle:
                return None, row.planned
            # A share for itself and each idle worker, rounded up: no share left over.
            leaf = -(-(row.planned - done) // (idle + 1))
        bounds = spec.source.bounds(conn, row.range.past(after), after)
        if bounds is None:
            return [], row.planned
        # Python's order only orients the arithmetic: the database places the points.
        try:
            low, high = sorted(bounds)
        except TypeError:  # parts Python cannot compare (a NULL in a composite key)
            low, high = bounds
        inside = _between(stats.bounds, after, high)
        pages = ahead(spec.source.key_of(rows[0]), spec.source.key_of(rows[-1]), high)
        density = None if pages is None else round(pages * len(rows))
        left = _estimate_left(stats, row, done, inside, density)
        if left is not None and left <= leaf:
            return None, done + left
        if left is None:  # nothing tells (composite keys, no statistics): fanout leaves
            left = spec.fanout * leaf
        parts = max(2, min(spec.fanout, -(-left // leaf)))
        targets = _targets([low, *_between(inside, low, high), high], parts)
        points = seek(conn, spec.source, row.range, bounds[0], targets)
        if not points:  # no room for a cut: go on, planned at the estimate
            return None, done + left
        return _children(row.range, points, after, left), row.planned

    def _claim(self, most: int) -> int:
        """Claim up to ``most`` of the local executor's idle workers that no other run has
        claimed, for this thread's range to split for; how many. The claim lasts until
        the page's step is over (``unclaim``), so runs that look at once do not all split
        for the same worker."""
        if most < 1 or not isinstance(self.executor, LocalExecutor):
            return 0
        idle = self.executor.idle
        if idle < 1:  # every worker busy: the common case, page after page
            return 0
        with self._lock:
            free = min(most, idle - sum(self._claims.values()))
            if free < 1:
                return 0
            self._claims[threading.get_ident()] = free
            return free

    def unclaim(self) -> None:
        """Release this thread's claim of idle workers (its children are submitted)."""
        if self._claims:  # unlocked: empty unless a run claimed
            with self._lock:
                self._claims.pop(threading.get_ident(), None)

    def _leaves(self, spec: MapSpec) -> int:
        """How many leaves a job's tree aims at: one per worker of a local executor;
        ``fanout**2`` elsewhere (a Celery deployment's workers are not known here)."""
        if isinstance(self.executor, LocalExecutor):
            return self.executor.workers
        return spec.fanout**2


def seek(
    conn: Connection, source: Source, rng: KeyRange, first: Key, targets: Sequence[Key]
) -> list[Key]:
    """Split points for what is left of ``rng`` past its key ``first``: for each target in
    turn, the smallest key of the range at or above it and above the last point found
    (one key read from the source: compared and ordered by the database). Whatever order
    the targets are in, the points are real keys of the range, above ``first`` and
    increasing in the database's order; a target with no key past it gives none."""
    points: list[Key] = []
    last = first
    for target in targets:
        found = source.page(conn, KeyRange(target, rng.hi), last, 1)
        if found:
            last = source.key_of(found[0])
            points.append(last)
    return points


def _children(
    rng: KeyRange, points: Sequence[Key], after: Key | None, rows: int | None
) -> Children:
    """``rng`` cut at ``points``, planned at an even share of the ``rows`` left past
    ``after`` each (if known); the first piece keeps the checkpoint ``after``."""
    pieces = rng.split(points)
    planned = None if rows is None else -(-rows // len(pieces))
    return [Child(piece, after if i == 0 else None, planned) for i, piece in enumerate(pieces)]


_STEPS = 64  # a bucket's parts that a target can fall on


def _targets(edges: Sequence[Key], parts: int) -> list[Key]:
    """Up to ``parts - 1`` keys that cut the stretch from ``edges[0]`` to ``edges[-1]``
    into parts of about equal rows, if the stretches between neighbouring edges
    (increasing) each hold about as many rows — a histogram's buckets; with two edges,
    even steps of key arithmetic. A cut that falls inside a bucket is placed by key
    arithmetic in it, to a 64th of the bucket (strings over the alphabet of a
    histogram's bounds); where there is no room for it, none (the cuts left are fewer,
    never piled on one key). Increasing in Python's order."""
    buckets = len(edges) - 1
    alphabet = ""
    if buckets > 1 and all(isinstance(edge, str) for edge in edges):
        alphabet = "".join(sorted(set().union(*edges)))  # type: ignore[arg-type]
    targets: list[Key] = []
    for k in range(1, parts):
        at = buckets * k / parts
        i = min(int(at), buckets - 1)
        step = round((at - i) * _STEPS)
        if step <= 0:
            target: Key | None = edges[i]
        elif step >= _STEPS:
            target = edges[i + 1]
        else:
            target = _inside(edges[i], edges[i + 1], step, alphabet)
        if target is not None and not _has_nul(target):
            targets.append(target)
    try:  # each once, increasing: equal or crossed targets would only make empty pieces
        return [t for n, t in enumerate(targets) if n == 0 or targets[n - 1] < t]  # type: ignore[operator]
    except TypeError:
        return list(dict.fromkeys(targets))


def _inside(lo: Key, hi: Key, step: int, alphabet: str) -> Key | None:
    """The key ``step / _STEPS`` of the way from ``lo`` to ``hi`` by key arithmetic (see
    ``interpolate`` for the ``alphabet``), or the nearest there is room for. Composite
    keys whose first differing part has no room (adjacent values: tenants 1 and 2) are
    cut where that part steps to ``hi``'s, the rest kept from ``lo``. None where there is
    no room at all."""
    try:
        points = interpolate(lo, hi, _STEPS, alphabet)
    except UnsupportedKey:
        return None
    if points:
        return points[min(len(points) - 1, (step * len(points)) // _STEPS)]
    if isinstance(lo, tuple) and isinstance(hi, tuple) and len(lo) == len(hi):
        i = next((i for i, (a, b) in enumerate(zip(lo, hi, strict=True)) if a != b), None)
        if i is not None:
            stepped = (*hi[: i + 1], *lo[i + 1 :])
            try:
                return stepped if lo < stepped < hi else None
            except TypeError:
                return None
    return None


def _has_nul(key: Key) -> bool:
    """Whether a string of ``key`` holds NUL, which PostgreSQL's text cannot (key
    arithmetic between ``'item1'`` and ``'item1999'`` pads with it)."""
    parts = key if isinstance(key, tuple) else (key,)
    return any(isinstance(part, str) and "\0" in part for part in parts)


def _between(bounds: Sequence[Key], after: Key | None, high: Key) -> list[Key]:
    """The histogram's ``bounds`` past ``after`` and below ``high`` in Python's order
    (which only aims: ``seek`` places the cuts), or none where it cannot compare them."""
    try:
        return [b for b in bounds if (after is None or after < b) and b < high]  # type: ignore[operator]
    except TypeError:
        return []


def _estimate_left(
    stats: Statistics, row: RangeRow, done: int, inside: Sequence[Key], density: int | None
) -> int | None:
    """The rows left in ``row``'s range past a full page (``done`` rows visited with it).

    Within its plan: what the plan leaves, or the page's ``density`` if smaller (a plan is
    an even share of the parent's estimate: the range may be sparse). With no plan (the
    root), or past it: the larger of the density and the statistics' word (the root: the
    source's estimated rows less those done; else the histogram's buckets past the page),
    a first estimate capped by the source's rows (keys far from even make a page's word
    wild; past a plan, the rows seen outweigh statistics that may be low); where nothing
    tells, past a plan as many again, and with none None."""
    if row.planned is not None and row.planned > done:
        planned = row.planned - done
        return planned if density is None else min(planned, density)
    words = [] if density is None else [density]
    if row.depth == 0 and stats.rows is not None:
        words.append(stats.rows - done)
    elif inside and stats.rows is not None and len(stats.bounds) > 1:
        words.append(round(len(inside) * stats.rows / (len(stats.bounds) - 1)))
    if not words:
        return row.planned
    left = max(0, *words)
    if row.planned is None and stats.rows is not None:
        left = min(left, stats.rows)
    return left


__all__ = ["Children", "Planner", "seek"]
