"""``manage.py shardkit_jobs [status|watch|cancel|resume ID]``: ``shardkit jobs`` on the
app's kit."""

from shardkit import cli

from ..cli import ShardkitCommand


class Command(ShardkitCommand):
    help = "List mapping jobs (newest first), or act on one: status, watch, cancel, resume."
    command = cli.jobs
