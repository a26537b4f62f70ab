"""The thread forms of the concurrency pieces, generated from their asyncio forms under
``shardkit/aio/`` by ``tools/generate_sync.py`` (CI checks they are current): edit those."""
