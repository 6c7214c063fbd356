"""Who owns what: tenant names, the ids that may form a key, and an owner check.

Every task, job, file and batch records the tenant that created it (``tenant``); the API
answers another tenant's ids as if they did not exist (404, never 403), and admins see all.
Producers that talk to Redis directly (the Python client, the CLI) act as ``settings.tenant``,
``default`` unless set, so a single-tenant setup has one tenant and nothing to configure.

Ids reach Redis key names (``{prefix}:job:<id>``): one that is not of the shape below never
forms a key, so ``J:custom_ids`` cannot name a job's internal hashes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from vlmq.config.errors import InvalidRequest

__all__ = [
    "DEFAULT_TENANT",
    "ID_PATTERN",
    "TENANT_PATTERN",
    "Caller",
    "check_id",
    "owner_of",
    "valid_id",
    "valid_tenant",
]

DEFAULT_TENANT = "default"
# Task and job ids: what a Redis key may be built from (config/schemas.py uses it for ids).
ID_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"
# Tenant names form keys too (a tenant's counters and fair-share set); no ':' or '.'-only.
TENANT_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

_ID = re.compile(ID_PATTERN)
_TENANT = re.compile(TENANT_PATTERN)


def valid_id(value: str) -> bool:
    return bool(_ID.match(value))


def check_id(what: str, value: str) -> str:
    """``value`` if it may form a key, else InvalidRequest naming ``what``."""
    if not valid_id(value):
        raise InvalidRequest(f"{what}: must match {ID_PATTERN} (letters, digits, _ . -)")
    return value


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
