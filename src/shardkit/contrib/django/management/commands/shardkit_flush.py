"""``manage.py shardkit_flush NAME | --all``: ``shardkit flush`` on the app's kit."""

from shardkit import cli

from ..cli import ShardkitCommand


class Command(ShardkitCommand):
    help = "Move the pending increments of a buffered counter (or --all) into the store."
    command = cli.flush
