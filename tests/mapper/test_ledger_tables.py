"""The mapper's ledger lives beside the store's tables, with the store's prefix, but is
the mapper's own: opening a kit makes none of it, and the mapper (of the sync kit or the
async one) makes it where it is missing when first used."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import shardkit
import shardkit.aio
from shardkit.mapper.tables import ledger_tables
from shardkit.store import open_store


@pytest.fixture
def prefix(store_url: str) -> Iterator[str]:
    """A prefix of the test's own; its tables are dropped afterwards."""
    prefix = f"skl{uuid.uuid4().hex[:8]}_"
    yield prefix
    store = open_store(store_url, prefix=prefix)
    ledger_tables(prefix).metadata.drop_all(store.engine)  # type: ignore[attr-defined]
    store.metadata.drop_all(store.engine)  # type: ignore[attr-defined]
    store.close()


def tables_of(kit: shardkit.Kit, prefix: str) -> set[str]:
    names = sa.inspect(kit.store.engine).get_table_names()  # type: ignore[attr-defined]
    return {name for name in names if name.startswith(prefix)}


def test_the_sync_kit_makes_the_ledger_when_it_first_maps(store_url: str, prefix: str) -> None:
    ledger = {f"{prefix}jobs", f"{prefix}ranges"}
    with shardkit.connect(store_url, prefix=prefix) as kit:
        made = tables_of(kit, prefix)
        assert f"{prefix}counters" in made
        assert not made & ledger  # the store's tables only
        assert kit.jobs() == []
        assert ledger <= tables_of(kit, prefix)


def test_the_async_kit_makes_the_ledger_when_it_first_reads_jobs(
    store_url: str, prefix: str
) -> None:
    ledger = {f"{prefix}jobs", f"{prefix}ranges"}

    async def read_jobs() -> list[shardkit.JobStatus]:
        async with shardkit.aio.connect(store_url, prefix=prefix) as kit:
            return await kit.jobs()

    assert asyncio.run(read_jobs()) == []
    with shardkit.connect(store_url, prefix=prefix) as kit:
        assert ledger <= tables_of(kit, prefix)
        with pytest.raises(shardkit.JobNotFound):
            kit.job("no-such-job")
