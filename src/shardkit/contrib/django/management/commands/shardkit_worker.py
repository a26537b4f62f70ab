"""``manage.py shardkit_worker [--interval S] [--once]``: ``shardkit worker`` on the app's
kit."""

from shardkit import cli

from ..cli import ShardkitCommand


class Command(ShardkitCommand):
    help = "Flush every buffered counter every --interval seconds, in the foreground."
    command = cli.worker
