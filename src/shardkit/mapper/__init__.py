"""Adaptive sharded mapping: visit every row of a huge table in parallel (see ``runner``)."""

from shardkit.mapper.job import Batch, Completion, Job
from shardkit.mapper.keys import Key, KeyRange
from shardkit.mapper.ledger import JobStatus
from shardkit.mapper.runner import Mapper
from shardkit.mapper.source import Source, Statistics, StatisticsSource, TableSource
from shardkit.mapper.spec import MapSpec, Signer

__all__ = [
    "Batch",
    "Completion",
    "Job",
    "JobStatus",
    "Key",
    "KeyRange",
    "MapSpec",
    "Mapper",
    "Signer",
    "Source",
    "Statistics",
    "StatisticsSource",
    "TableSource",
]
