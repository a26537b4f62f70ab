"""Adaptive sharded mapping: visit every row of a huge table in parallel (see ``runner``).

The names below are imported from their modules when first used, so a process that only
counts (a kit opened for counters, ``shardkit get``) never loads the mapper."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardkit.mapper.task import TASK

if TYPE_CHECKING:
    from shardkit.mapper.job import Batch, Completion, Job, Records, RowDict, RowDicts
    from shardkit.mapper.keys import Key, KeyRange
    from shardkit.mapper.ledger import JobStatus
    from shardkit.mapper.runner import Mapper
    from shardkit.mapper.source import Source, Statistics, StatisticsSource, TableSource
    from shardkit.mapper.spec import MapSpec, Signer

_WHERE = {
    "Batch": "job",
    "Completion": "job",
    "Job": "job",
    "Records": "job",
    "RowDict": "job",
    "RowDicts": "job",
    "Key": "keys",
    "KeyRange": "keys",
    "JobStatus": "ledger",
    "Mapper": "runner",
    "Source": "source",
    "Statistics": "source",
    "StatisticsSource": "source",
    "TableSource": "source",
    "MapSpec": "spec",
    "Signer": "spec",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit.mapper' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"shardkit.mapper.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "TASK",
    "Batch",
    "Completion",
    "Job",
    "JobStatus",
    "Key",
    "KeyRange",
    "MapSpec",
    "Mapper",
    "Records",
    "RowDict",
    "RowDicts",
    "Signer",
    "Source",
    "Statistics",
    "StatisticsSource",
    "TableSource",
]
