"""The ``vlmq`` command line.

Commands are imported lazily: ``vlmq submit`` or ``vlmq --help`` never import
torch; only worker-side commands (``run``, ``worker``, ``build-tiny-model``)
load the worker package when they are invoked.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import click

from config.logs import configure_logging

__all__ = ["cli", "main"]

# command name -> "module:attribute" of a click command
_COMMANDS = {
    "build-tiny-model": "workers.cli:build_tiny_model",
    "run": "workers.cli:run",
    "worker": "workers.cli:worker",
    "demo": "producers.demo:demo",
    "make-examples": "producers.examples:make_examples_command",
    "submit": "producers.commands:submit",
    "status": "producers.commands:status",
    "results": "producers.commands:results",
    "cancel": "producers.commands:cancel",
    "serve": "producers.serve:serve",
    "healthcheck": "producers.healthcheck:healthcheck",
}


class LazyGroup(click.Group):
    """A click group whose commands are imported only when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        command: click.Command = getattr(importlib.import_module(module_name), attribute)
        return command


@click.group(cls=LazyGroup)
@click.option(
    "--log-level",
    default=lambda: os.environ.get("VLMQ_LOG_LEVEL", "warning"),
    show_default="warning",
    help="Logging level.",
)
def cli(log_level: str) -> None:
    """vlmq: batched vision-language-model inference on a fleet of workers."""
    configure_logging(log_level)


def main(argv: list[str] | None = None) -> Any:
    return cli.main(args=argv, prog_name="vlmq")
