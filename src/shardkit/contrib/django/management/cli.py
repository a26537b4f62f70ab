"""Management commands that run a ``shardkit`` command on the Django app's kit."""

from __future__ import annotations

import argparse
from typing import Any

import click
from django.core.management.base import BaseCommand, CommandError, CommandParser

from shardkit import cli
from shardkit.errors import ShardkitError

from ..conf import kit


class ShardkitCommand(BaseCommand):
    """``manage.py <name> ARGS`` runs ``shardkit <command> ARGS`` on the app's kit: the
    same arguments, output and errors (a ``CommandError``). The command's own options
    are declared to Django too, so they may come first (``shardkit_flush --all``)."""

    command: click.Command

    def add_arguments(self, parser: CommandParser) -> None:
        for option in self._options():
            parser.add_argument(
                *option.opts,
                dest=f"shardkit_{option.name}",
                action="store_true" if option.is_flag else "store",
                help=option.help,
            )
        parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's arguments")

    def _options(self) -> list[click.Option]:
        return [param for param in self.command.params if isinstance(param, click.Option)]

    def handle(self, *args: str, **options: Any) -> None:
        argv: list[str] = []
        for option in self._options():
            value = options.get(f"shardkit_{option.name}")
            if value is True:
                argv.append(option.opts[0])
            elif value not in (None, False):
                argv += [option.opts[0], str(value)]
        try:
            self.command.main(
                [*argv, *args],
                prog_name=f"manage.py {self.command.name}",
                obj=cli.Context.on_kit(kit()),
                standalone_mode=False,
            )
        except click.ClickException as exc:
            raise CommandError(exc.format_message()) from exc
        except ShardkitError as exc:
            raise CommandError(str(exc)) from exc
