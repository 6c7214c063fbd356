"""``vlmq serve``: run the HTTP API (FastAPI on uvicorn).

Without an API key configured the API is open to anyone who can reach it, so
it then binds only to a loopback address, answers loopback Host names only, and says so.
"""

from __future__ import annotations

import ipaddress
import logging

import click

__all__ = ["is_loopback", "serve"]

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname might resolve anywhere


@click.command()
@click.option("--host", default=None, help="Bind address [default: VLMQ_API__HOST, 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Port [default: VLMQ_API__PORT, 8000].")
def serve(host: str | None, port: int | None) -> None:
    """Serve the HTTP API: tasks, jobs, and OpenAI-compatible files and batches."""
    import uvicorn

    from vlmq.config.settings import Settings
    from vlmq.producers.api.app import create_app

    settings = Settings()
    host = host or settings.api.host
    port = port or settings.api.port
    api = settings.api
    if not (api.api_keys or api.tenant_keys or api.admin_keys):
        if not is_loopback(host):
            raise click.UsageError(
                f"refusing to serve without API keys on {host}: set VLMQ_API__API_KEYS "
                "(a JSON list) or VLMQ_API__TENANT_KEYS (a JSON object key -> tenant), or "
                "bind to 127.0.0.1"
            )
        click.echo(
            f"vlmq serve: no API keys configured: unauthenticated, loopback only ({host})",
            err=True,
        )
        log.warning("serving without authentication on %s (loopback only)", host)
    click.echo(f"vlmq serve: listening on http://{host}:{port} (API description: /docs)", err=True)
    # log_config=None: uvicorn logs through the logging the CLI configured.
    uvicorn.run(create_app(settings), host=host, port=port, log_config=None)
