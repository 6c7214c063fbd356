"""Who owns what: tenant names and an owner check.

Every task, job, file and batch records the tenant that created it (``tenant``); the API
answers another tenant's ids as if they did not exist (404, never 403), and admins see all.
Producers that talk to Redis directly (the Python client, the CLI) act as ``settings.tenant``,
``default`` unless set, so a single-tenant setup has one tenant and nothing to configure.

Which ids may name a task or a job is ``config/ids.py``'s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_TENANT", "TENANT_PATTERN", "Caller", "owner_of", "valid_tenant"]

DEFAULT_TENANT = "default"
# Tenant names form keys too (a tenant's counters and fair-share set); no ':' or '.'-only.
TENANT_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

_TENANT = re.compile(TENANT_PATTERN)


def valid_tenant(value: str) -> bool:
    return bool(_TENANT.match(value))


def owner_of(record: Mapping[str, str]) -> str:
    """The tenant a stored record belongs to (records from before tenants: the default)."""
    return record.get("tenant") or DEFAULT_TENANT


@dataclass(frozen=True)
class Caller:
    """Who is asking: a tenant, and whether it may see every tenant's work."""

    tenant: str = DEFAULT_TENANT
    admin: bool = False

    def may_see(self, record: Mapping[str, str]) -> bool:
        return self.admin or owner_of(record) == self.tenant
