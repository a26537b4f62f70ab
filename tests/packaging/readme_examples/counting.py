"""The README's "Use" example on one store and one cache, as a script a clean install
runs: ``python counting.py STORE_URL CACHE_URL PREFIX`` prints what it counted, as JSON."""

import json
import sys
import uuid

import shardkit

store, cache, prefix = sys.argv[1:]
with shardkit.connect(store=store, cache=cache, prefix=prefix) as kit:
    name = f"readme:{uuid.uuid4().hex}"
    votes = kit.sharded(name, shards=20)
    votes.incr()
    votes.incr(5, key="request-8f2c")
    repeated = votes.incr(5, key="request-8f2c")  # a retried call applies once
    votes.decr(2)
    hits = kit.buffered(f"{name}:hits", interval=5.0)
    hits.incr(7)
    hits.incr(-3)
    hits.flush()
    print(
        json.dumps(
            {
                "value": votes.value(),
                "fresh": votes.value(fresh=True),
                "repeated": repeated,
                "shards": votes.shards,
                "hits": list(hits.parts()),
            }
        )
    )
