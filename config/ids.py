"""Ids: which strings may name a task or a job, and the ids vlmq makes.

Ids reach Redis key names (``{prefix}:job:<id>``) and result-store keys
(``{job}/{task}.{delivery}.json``): one that is not of the shape below never forms a key, so
``J:custom_ids`` cannot name a job's internal hashes and ``..`` cannot name a folder. The Lua
side applies the same rule (``lua/common.lua`` ``plain``), so the pull and the worker agree on
every id.

A fed task's id is made, not chosen: ``<job number>.<claim>.<submission>`` (the job's short
number, a fixed-size digest of its custom_id, the submitting run), so its status is found from
its id alone after its hash was folded into its job. A message's tag (Celery's
``properties.delivery_tag``: a random 128-bit id every producer draws for each message; the
SHA-1 of its bytes for a message without one) is what its task's hash records, so that a
message that names a task it is not never touches that task (``lua/intake.lua``, identity).
"""

from __future__ import annotations

import hashlib
import re
import secrets

from vlmq.config.errors import InvalidRequest

__all__ = [
    "FED_ID",
    "ID_MAX_LENGTH",
    "ID_PATTERN",
    "check_id",
    "claim_of",
    "fed_task_id",
    "message_tag",
    "new_submission_id",
    "valid_id",
]

# Letters, digits, '_', '.', '-', with at least one that is not a dot (a pattern without
# look-arounds: pydantic's regex engine has none).
ID_PATTERN = r"^[A-Za-z0-9_.-]*[A-Za-z0-9_-][A-Za-z0-9_.-]*$"
ID_MAX_LENGTH = 128
FED_ID = re.compile(r"^(\d+)\.([0-9a-f]{20})\.([0-9a-f]+)$")

_ID = re.compile(ID_PATTERN)
_TAG_KEY = '"delivery_tag":"'
_TAG = re.compile(r"^[A-Za-z0-9-]+$")
_TAG_MAX = 64


def valid_id(value: str) -> bool:
    return len(value) <= ID_MAX_LENGTH and bool(_ID.match(value))


def check_id(what: str, value: str) -> str:
    """``value`` if it may form a key, else InvalidRequest naming ``what``."""
    if not valid_id(value):
        raise InvalidRequest(
            f"{what}: must be 1-{ID_MAX_LENGTH} of letters, digits, _ . - (not dots only)"
        )
    return value


def new_submission_id() -> str:
    """One submitter's id within its job (its tasks' ids end with it)."""
    return secrets.token_hex(5)


def claim_of(custom_id: str) -> str:
    """A custom_id's claim: a fixed-size digest (80 bits: for 10 million custom_ids in one job
    the chance of any two sharing one is ~4e-11), so a finished task's record is short
    whatever its custom_id's length."""
    return hashlib.sha1(custom_id.encode()).hexdigest()[:20]


def fed_task_id(job_number: str, claim: str, submission: str) -> str:
    return f"{job_number}.{claim}.{submission}"


def message_tag(message: str) -> str:
    """What a task's hash records of the message it was created with: the message's
    ``delivery_tag`` (vlmq's encoder writes it last, in compact JSON; lua/intake.lua reads the
    same), else the SHA-1 of its bytes, as the pull makes it for a message without one."""
    at = message.rfind(_TAG_KEY)
    if at >= 0:
        start = at + len(_TAG_KEY)
        end = message.find('"', start)
        tag = message[start:end]
        if 0 < len(tag) <= _TAG_MAX and _TAG.match(tag):
            return tag
    return "sha1:" + hashlib.sha1(message.encode()).hexdigest()
