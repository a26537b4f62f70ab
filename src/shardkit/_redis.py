"""What the Redis caches (``shardkit.cache.redis``, ``shardkit.cache.cluster``) and their
concurrency pieces (``shardkit.aio``, ``shardkit._sync``) share: redis-py, loaded when
first used, the Lua scripts they run, and the error of an increment no replica
acknowledged."""

from __future__ import annotations

import hashlib
from typing import Any

from shardkit.errors import MissingDriver

# INCRBY creates a missing key; a counter's cached value must not be created by a write
# (it would hold the delta alone), so the increment is conditional, in one atomic script.
# The new value is returned as GET's string: Lua numbers are doubles, exact only to 2**53.
_INCR_IF_EXISTS = """
if redis.call('exists', KEYS[1]) == 1 then
  redis.call('incrby', KEYS[1], ARGV[1])
  return redis.call('get', KEYS[1])
end
return false
"""
# SET NX of many keys, ARGV[1] their TTL in ms (0: none), then their values; nothing
# returned.
_ADD_MANY = """
local ttl = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  if ttl > 0 then
    redis.call('set', key, ARGV[i + 1], 'NX', 'PX', ttl)
  else
    redis.call('set', key, ARGV[i + 1], 'NX')
  end
end
"""
# The same for many keys, their deltas in ARGV; nothing returned.
_INCR_MANY_IF_EXIST = """
for i, key in ipairs(KEYS) do
  if redis.call('exists', key) == 1 then
    redis.call('incrby', key, ARGV[i])
  end
end
"""

# Increments guarded by records of their keys (``Recording.incr_once``). KEYS: the sums,
# then one record per write; ARGV: how many sums, the records' TTL in ms, then each
# write's sum (its index in KEYS) and delta. Nothing changes unless every sum exists.
# Returns the sums after (as GET's strings), then 1 for each write applied, 0 for each
# whose record was set already.
_INCR_ONCE = """
local count = tonumber(ARGV[1])
for i = 1, count do
  if redis.call('exists', KEYS[i]) == 0 then
    return false
  end
end
local flags = {}
for i = count + 1, #KEYS do
  local at = 2 * (i - count) + 1
  if redis.call('set', KEYS[i], 1, 'NX', 'PX', ARGV[2]) then
    redis.call('incrby', KEYS[tonumber(ARGV[at])], ARGV[at + 1])
    flags[#flags + 1] = 1
  else
    flags[#flags + 1] = 0
  end
end
local result = {}
for i = 1, count do
  result[i] = redis.call('get', KEYS[i])
end
for i, flag in ipairs(flags) do
  result[count + i] = flag
end
return result
"""


def redis_module() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise MissingDriver(
            "the Redis cache needs its driver: pip install 'shardkit[redis]'"
        ) from exc
    return redis


class Unreplicated(Exception):
    """An increment on a Redis Cluster primary that has a replica, which no replica
    acknowledged within the wait: a failover could bring the key back below it, so its
    value is not handed out (the increment is made again, the value skipped)."""


class Script:
    """A Lua script, run by its digest (loaded into the server the first time it is
    missing there)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


INCR = Script(_INCR_IF_EXISTS)
ADDS = Script(_ADD_MANY)
INCR_MANY = Script(_INCR_MANY_IF_EXIST)
INCR_ONCE = Script(_INCR_ONCE)
