"""``python -m shardkit``: the ``shardkit`` command."""

from shardkit.cli import main

main()
