"""The README's "Async" example on one store and one cache, as a script a clean install
runs: ``python counting_async.py STORE_URL CACHE_URL PREFIX`` prints what it counted, as
JSON."""

import asyncio
import json
import sys
import uuid

import shardkit.aio


async def main(store: str, cache: str, prefix: str) -> dict[str, object]:
    async with shardkit.aio.connect(store=store, cache=cache, prefix=prefix) as kit:
        name = f"readme:{uuid.uuid4().hex}"
        views = await kit.sharded(name, shards=32)
        await views.incr()
        await views.incr(5, key="req-1")
        repeated = await views.incr(5, key="req-1")  # a retried call applies once
        await views.decr()
        together = await asyncio.gather(*(views.incr() for _ in range(10)))
        return {
            "value": await views.value(),
            "fresh": await views.value(fresh=True),
            "repeated": repeated,
            "together": together.count(True),
            "shards": await views.shards(),
            "values": await kit.values([name]),
        }


print(json.dumps(asyncio.run(main(*sys.argv[1:]))))
