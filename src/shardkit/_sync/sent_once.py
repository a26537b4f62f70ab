# Generated from shardkit/aio/sent_once.py by tools/generate_sync.py: edit that one.
"""Increments sent once: ``AsyncSentOnce`` for a ``redis.asyncio`` client, ``SentOnce``
for a sync one, written once here, the sync form generated from it
(``shardkit/_sync/sent_once.py``, by ``tools/generate_sync.py``)."""

from __future__ import annotations

from typing import Any, Protocol


class Lending(Protocol):
    """Where a sender's connections come from, and go back to: the form's choice
    (``shardkit.cache.redis.Held``, ``shardkit.aio.redis.Lent``)."""

    def take(self) -> Any:
        """A connection, connected, with no reply waiting on it."""

    def give(self, conn: Any, sound: bool) -> None:
        """``conn`` back, used; not ``sound`` (a reply may be on its way): disconnected
        first, so that its next command starts on a new socket."""

    def close(self) -> None:
        """Hand back what is held."""


class SentOnce:
    """Plays ``Client`` for a cache: the redis-py client's commands, except that those
    that add (``INCRBY``, ``EVALSHA`` of the increment scripts) are sent once, on a
    connection from ``lending``, and never again. redis-py retries a command whose
    connection fails where the client has a retry policy (one made by its constructor
    retries ten times; a cluster client retries a few times on every node): an increment
    whose reply was lost would count twice. Here it raises, and its caller may or may
    not have counted, as the counters' contracts say."""

    def __init__(self, client: Any, lending: Lending) -> None:
        from redis import ResponseError  # the client's own: its driver is there

        self.client = client
        self._lending = lending
        self._refused = ResponseError

    def get(self, name: str) -> Any:
        return self.client.get(name)

    def mget(self, keys: list[str]) -> Any:
        return self.client.mget(keys)

    def set(self, name: str, value: int, *, nx: bool, px: int | None) -> Any:
        return self.client.set(name, value, nx=nx, px=px)

    def delete(self, name: str) -> Any:
        return self.client.delete(name)

    def script_load(self, script: str) -> Any:
        return self.client.script_load(script)

    def incrby(self, name: str, amount: int) -> Any:
        return self._once("INCRBY", name, amount)

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        return self._once("EVALSHA", sha, numkeys, *keys_and_args)

    def _once(self, *command: Any) -> Any:
        conn = self._lending.take()
        sound = False
        try:
            conn.send_command(*command)
            reply = conn.read_response()
            sound = True
        except self._refused:  # the server's answer, read whole: the socket is sound
            sound = True
            raise
        finally:
            self._lending.give(conn, sound)
        return reply

    def close(self) -> None:
        """Hand back the connections held."""
        self._lending.close()


__all__ = ["Lending", "SentOnce"]
