"""The ``vlmq`` command line.

Commands are imported lazily: ``vlmq submit`` or ``vlmq --help`` never import
torch; only worker-side commands (``run``, ``worker``, ``build-tiny-model``)
load the worker package when they are invoked.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from vlmq.config.errors import ConfigError, VlmqError
from vlmq.config.logs import LOG_FORMATS, configure_logging

__all__ = ["cli", "main"]

# command name -> "module:attribute" of a click command
_COMMANDS = {
    "build-tiny-model": "vlmq.workers.cli:build_tiny_model",
    "run": "vlmq.workers.cli:run",
    "worker": "vlmq.workers.cli:worker",
    "demo": "vlmq.producers.demo:demo",
    "make-examples": "vlmq.producers.examples:make_examples_command",
    "submit": "vlmq.producers.commands:submit",
    "status": "vlmq.producers.commands:status",
    "results": "vlmq.producers.commands:results",
    "cancel": "vlmq.producers.commands:cancel",
    "usage": "vlmq.producers.commands:usage",
    "layout": "vlmq.producers.layout:layout",
    "serve": "vlmq.producers.serve:serve",
    "healthcheck": "vlmq.producers.healthcheck:healthcheck",
    "settings": "vlmq.producers.settings_docs:settings",
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
    envvar="VLMQ_LOG_LEVEL",
    default="warning",
    show_default=True,
    help="Logging level: debug, info, warning or error [VLMQ_LOG_LEVEL].",
)
@click.option(
    "--log-format",
    envvar="VLMQ_LOG_FORMAT",
    type=click.Choice(LOG_FORMATS),
    default="text",
    show_default=True,
    help="Log lines as text, or json: one JSON object per line, with task, job, batch and "
    "worker ids [VLMQ_LOG_FORMAT].",
)
def cli(log_level: str, log_format: str) -> None:
    """vlmq: batched vision-language-model inference on a fleet of workers."""
    configure_logging(log_level, log_format)


def main(argv: list[str] | None = None) -> Any:
    try:
        return cli.main(args=argv, prog_name="vlmq")
    except ConfigError as exc:  # a setting or install that cannot work: say which, no trace
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    except VlmqError as exc:  # refused input or a quota: the message says why, no trace
        from vlmq.producers.failures import EXIT_OUTAGE, describe, is_outage

        if is_outage(exc):  # the store failed under a command that did not say more
            click.echo(f"Error: {describe(exc)}; rerunning the same command is safe", err=True)
            sys.exit(EXIT_OUTAGE)
        click.echo(f"Error: {exc.message} ({exc.code})", err=True)
        sys.exit(1)
    except Exception as exc:
        # Redis or the store failed under a command that did not say more (the producer
        # commands do: producers/failures.py): one line, not a traceback.
        from vlmq.producers.failures import EXIT_OUTAGE, describe, is_outage

        if not is_outage(exc):
            raise
        click.echo(f"Error: {describe(exc)}; rerunning the same command is safe", err=True)
        sys.exit(EXIT_OUTAGE)
