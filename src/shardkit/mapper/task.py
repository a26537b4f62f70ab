"""The executor's task of the mapper: bound by the kits, submitted by ``Mapper``."""

from shardkit import metrics

TASK = metrics.action("map_range")
"""The executor's task that visits one range of a job (a background task: its failures
are ridden out)."""

__all__ = ["TASK"]
