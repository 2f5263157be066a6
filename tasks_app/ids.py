"""Prefixed ULID identifiers (`task_`, `resp_`, `msg_`, function calls `fc_` and `call_`; webhooks:
`whep_`, `whmsg_`, `evt_`).

A ULID is 48 bits of milliseconds and 80 random bits in Crockford base32, so
ids sort by creation time; ordering lists by id is ordering by age. Within one
millisecond a process increments the random part so its own ids stay ordered.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_ULID_RE = re.compile(r"^[0-7][0-9A-HJKMNP-TV-Z]{25}$")
_lock = threading.Lock()
_last_ms = -1
_last_rand = 0

TASK_PREFIX = "task_"
RESPONSE_PREFIX = "resp_"
MESSAGE_PREFIX = "msg_"
FUNCTION_CALL_PREFIX = "fc_"
CALL_PREFIX = "call_"
CONVERSATION_PREFIX = "conv_"
FUNCTION_CALL_OUTPUT_PREFIX = "fco_"
WEBHOOK_ENDPOINT_PREFIX = "whep_"
# A delivery's id is its `webhook-id` header: one per event and endpoint, the same on every attempt.
WEBHOOK_DELIVERY_PREFIX = "whmsg_"
WEBHOOK_EVENT_PREFIX = "evt_"
# OpenAI's Files and Batch APIs (PROFILE.md 12.2); OpenAI's file ids take a hyphen.
FILE_PREFIX = "file-"
BATCH_PREFIX = "batch_"
BATCH_REQUEST_PREFIX = "batch_req_"


def _encode(value: int, length: int) -> str:
    chars = []
    for _ in range(length):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def new_ulid() -> str:
    """Return a new 26-character ULID, monotonic within this process."""
    global _last_ms, _last_rand
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms <= _last_ms:
            ms = _last_ms
            rand = (_last_rand + 1) & ((1 << 80) - 1)
            if rand == 0:  # 2^80 ids in one millisecond: move to the next one
                ms += 1
                rand = int.from_bytes(os.urandom(10), "big")
        else:
            rand = int.from_bytes(os.urandom(10), "big")
        _last_ms, _last_rand = ms, rand
    return _encode(ms, 10) + _encode(rand, 16)


def new_task_id() -> str:
    return TASK_PREFIX + new_ulid()


def new_response_id() -> str:
    return RESPONSE_PREFIX + new_ulid()


def new_message_id() -> str:
    return MESSAGE_PREFIX + new_ulid()


def new_function_call_id() -> str:
    return FUNCTION_CALL_PREFIX + new_ulid()


_CALL_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def new_call_id(length: int | None = None) -> str:
    """A function call's ``call_id``: ``call_`` + ULID, or ``length`` letters and digits where a model family
    reads only ids of that length back (Mistral's templates refuse any id but 9 alphanumerics)."""
    if length is None:
        return CALL_PREFIX + new_ulid()
    return "".join(secrets.choice(_CALL_ID_ALPHABET) for _ in range(length))


def new_conversation_id() -> str:
    return CONVERSATION_PREFIX + new_ulid()


def new_function_call_output_id() -> str:
    return FUNCTION_CALL_OUTPUT_PREFIX + new_ulid()


def new_webhook_endpoint_id() -> str:
    return WEBHOOK_ENDPOINT_PREFIX + new_ulid()


def new_webhook_delivery_id() -> str:
    return WEBHOOK_DELIVERY_PREFIX + new_ulid()


def new_webhook_event_id() -> str:
    return WEBHOOK_EVENT_PREFIX + new_ulid()


def new_file_id() -> str:
    return FILE_PREFIX + new_ulid()


def new_batch_id() -> str:
    return BATCH_PREFIX + new_ulid()


def is_prefixed_ulid(value: str, prefix: str) -> bool:
    """True when ``value`` is ``prefix`` followed by a well-formed ULID."""
    return value.startswith(prefix) and bool(_ULID_RE.match(value[len(prefix) :]))


def ulid_floor(unix_ms: int) -> str:
    """The smallest ULID of millisecond ``unix_ms``: ``id >= prefix + ulid_floor(t)`` selects ids made from t on."""
    return _encode(max(0, unix_ms), 10) + "0" * 16
