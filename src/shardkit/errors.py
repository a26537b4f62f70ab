"""The one exception tree of shardkit: every error the library raises is a ShardkitError.

Validation errors are raised before anything is written, so a failed call leaves the
store as it was. Backend errors wrap the driver's exception (``raise ... from exc``)
and never carry a password: URLs in messages are redacted.
"""

from __future__ import annotations


class ShardkitError(Exception):
    """Root of every error raised by shardkit."""


class ValidationError(ShardkitError, ValueError):
    """Bad input to a public call; nothing was written."""


class InvalidName(ValidationError):
    """A counter name or idempotency key that is empty, too long or has control characters."""


class InvalidDelta(ValidationError):
    """A delta that is not an int (bools and floats included), is outside signed 64-bit,
    or is larger than the counter kind takes in one call (see each kind's ``incr``)."""


class KeysUnsupported(ValidationError):
    """An idempotency key given where the backends cannot honour it: a buffered counter's
    increment on memcached, which cannot record a key in one atomic step with the
    increment it guards. Nothing was written."""


class InvalidShardCount(ValidationError):
    """A shard count below 1 or above the kit's configured maximum."""


class ConfigurationError(ShardkitError):
    """A kit that cannot be built: unknown URL scheme, bad option, missing driver."""


class MissingDriver(ConfigurationError):
    """The driver of a backend is not installed; the message names the extra to install."""


class CounterNotFound(ShardkitError, LookupError):
    """A counter was looked up by name and does not exist."""


class StoreNotFound(ShardkitError, LookupError):
    """A store opened to read only (``connect(create=False)``) that holds no tables of
    its prefix, or a SQLite file that does not exist: nothing was created."""


class CounterKindMismatch(ShardkitError):
    """A name is already used by a counter of another kind."""


class BackendError(ShardkitError):
    """A store or cache operation failed. Whether a failed write was applied is unknown:
    retry it with the same idempotency key to make the retry safe."""


class CounterOverflow(ShardkitError):
    """A flush that would take a counter's stored value outside signed 64-bit: refused,
    its pending increments kept where they were."""


class FlushFailed(ShardkitError):
    """Some counters could not be flushed; every other one was. ``failed`` maps each
    failed counter's name to its error, ``moved`` is what the others moved (as
    ``flush_all`` returns it)."""

    def __init__(self, failed: dict[str, ShardkitError], moved: dict[str, int]) -> None:
        listed = "; ".join(f"{name!r}: {error}" for name, error in sorted(failed.items()))
        super().__init__(f"{len(failed)} counter(s) could not be flushed: {listed}")
        self.failed = failed
        self.moved = moved


class BackendUnavailable(BackendError):
    """A store or cache server could not be reached (the message names the redacted URL)."""


class UnsupportedKey(ValidationError):
    """A key value the mapper cannot carry: keys are ints, strings, bytes, UUIDs or
    tuples of those."""


class JobNotFound(ShardkitError, LookupError):
    """A mapping job was looked up by id and does not exist."""


class JobFailed(ShardkitError):
    """A mapping job stopped: a range failed more often than its retries allow, or
    ``on_complete`` raised. ``Job.resume()`` retries it."""


class JobTimeout(ShardkitError, TimeoutError):
    """``Job.wait`` gave up before the job finished; the job goes on."""


class UntrustedPayload(ShardkitError):
    """A pickled job payload whose signature does not match the kit's secret: rejected
    without being unpickled."""
