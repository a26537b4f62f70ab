"""The thread forms of the concurrency pieces, generated from their asyncio forms under
``shardkit/aio/`` (those marked for it) by ``tools/generate_sync.py``; the tests check
they are current: edit those."""
