"""An OpenAI batch as batcher keeps it: the Batch object, its statuses and ids, and the checks of what creates one.

How a batch lives in Redis is in batcher/batches/__init__.py.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rqbatcher.errors import quoted
from rqbatcher.jobs import keys
from rqbatcher.jobs.redis_text import as_text

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
ACTIVE = ("validating", "in_progress")  # statuses a cancel or an expiry can still end
ENDED = ("failed", "completed", "expired", "cancelled")
WINDOW_PATTERN = re.compile(r"(\d+)([smhd])")
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DEFAULT_COMPLETION_WINDOW = "24h"  # OpenAI's only window; any `<n>s|m|h|d` works here
DEFAULT_BATCH_RETENTION_S = 7 * 86400  # a batch, its lines and its feed, counted from its creation
MAX_BATCH_METADATA_ITEMS = 16  # OpenAI's limits on a batch's metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
EXPIRY_ANCHOR = "created_at"  # OpenAI's only anchor of `output_expires_after` (and of a file's `expires_after`)
MIN_OUTPUT_EXPIRY_S = 3600  # OpenAI's range of `output_expires_after.seconds`
MAX_OUTPUT_EXPIRY_S = 30 * 86400
OUTPUT_EXPIRY_SHAPE = (f'output_expires_after is {{"anchor": "{EXPIRY_ANCHOR}", "seconds": {MIN_OUTPUT_EXPIRY_S} to '
                       f'{MAX_OUTPUT_EXPIRY_S}}}')
OUTPUT_EXPIRY_MARGIN_S = 3600  # a batch ends a little after its window (the first reader expires it)

class BatchNotFound(LookupError):
    """No such batch: never created, past its retention, or another owner's."""


class BatchInputError(ValueError):
    """The batch cannot be created as asked (window, metadata, endpoint, or an empty file)."""


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # batcher serves no reasoning model


class BatchUsage(BaseModel):
    """OpenAI's batch `usage`: the sum over the output lines (the requests that succeeded, as OpenAI bills), counted
    by the script that records each line, so it is exact through retries as the counts are."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0

    @classmethod
    def of(cls, input_tokens: int, cached_tokens: int, output_tokens: int) -> BatchUsage:
        return cls(input_tokens=input_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                   output_tokens=output_tokens, total_tokens=input_tokens + output_tokens)


class BatchErrorItem(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem]


class Batch(BaseModel):
    """OpenAI's Batch object, as a gateway serves it; `owner`, `queue` and `model` are ours."""

    model_config = ConfigDict(frozen=True)

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str | None = None
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    usage: BatchUsage = Field(default_factory=BatchUsage)
    owner: str | None = None
    queue: str
    model: str | None = None
    output_expires_at: int | None = Field(None, description="when the output and error files expire (once ended)")

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @classmethod
    def from_hash(cls, raw: dict) -> Batch:
        h = {as_text(k): as_text(v) for k, v in raw.items()}
        counts = RequestCounts(total=int(h.get("total", 0)), completed=int(h.get("completed", 0)),
                               failed=int(h.get("failed", 0)))
        usage = BatchUsage.of(*(int(h.get(f, 0)) for f in ("input_tokens", "cached_tokens", "output_tokens")))
        ended = h["status"] in ENDED
        times = {f: int(float(h[f])) for f in ("created_at", "in_progress_at", "expires_at", "finalizing_at",
                                               "completed_at", "failed_at", "expired_at", "cancelling_at",
                                               "cancelled_at", "output_expires_at") if h.get(f)}
        return cls(
            id=h["id"], endpoint=h["endpoint"], completion_window=h["completion_window"], status=h["status"],
            errors=BatchErrors.model_validate_json(h["errors"]) if h.get("errors") else None,
            input_file_id=h.get("input_file_id") or None, request_counts=counts, usage=usage,
            output_file_id=output_file_id(h["id"]) if ended and counts.completed else None,
            error_file_id=error_file_id(h["id"]) if ended and counts.failed else None,
            metadata=json.loads(h["metadata"]) if h.get("metadata") else None,
            owner=h.get("owner") or None, queue=h["queue"], model=h.get("model") or None, **times)


def output_file_id(batch_id: str) -> str:
    return f"{batch_id}_output"


def error_file_id(batch_id: str) -> str:
    return f"{batch_id}_errors"


def batch_of_file(file_id: str) -> tuple[str, bool] | None:
    """(batch id, whether it is the error file) of a batch's output or error file id; None for any other id."""
    for suffix, errors in ((output_file_id(""), False), (error_file_id(""), True)):
        if isinstance(file_id, str) and file_id.startswith(keys.BATCH_ID_PREFIX) and file_id.endswith(suffix):
            return file_id[:-len(suffix)], errors
    return None


def parse_window(window: str) -> int:
    """Seconds in a completion window such as `24h`, `30m`, `45s` or `2d`."""
    match = WINDOW_PATTERN.fullmatch(window) if isinstance(window, str) else None
    if match is None or int(match.group(1)) < 1:
        raise BatchInputError(f"completion_window is a number and a unit (s, m, h, d), such as 24h; got "
                              f"{quoted(window)}")
    return int(match.group(1)) * WINDOW_UNITS[match.group(2)]


def parse_output_expiry(expires_after: object) -> int | None:
    """The seconds of OpenAI's `output_expires_after` ({"anchor": "created_at", "seconds": 3600..2592000}); None
    (the batch's retention) when absent. The anchor is the files' creation: the batch's end."""
    if expires_after is None:
        return None
    if not isinstance(expires_after, dict) or set(expires_after) != {"anchor", "seconds"} or (
            expires_after["anchor"] != EXPIRY_ANCHOR):
        raise BatchInputError(OUTPUT_EXPIRY_SHAPE + f"; got {quoted(expires_after)}")
    return check_output_expiry(expires_after["seconds"])


def check_output_expiry(seconds: object) -> int | None:
    """`seconds` if it is a number of seconds that OpenAI's `output_expires_after` allows (None passes)."""
    if seconds is not None and (not isinstance(seconds, int) or isinstance(seconds, bool)
                                or not MIN_OUTPUT_EXPIRY_S <= seconds <= MAX_OUTPUT_EXPIRY_S):
        raise BatchInputError(OUTPUT_EXPIRY_SHAPE + f"; got {quoted(seconds)} seconds")
    return seconds


def outlasting_retention(retention_s: int, completion_window: str, output_expires_s: int | None) -> int:
    """A batch's retention, long enough to keep its output files as asked: they expire `output_expires_s` after the
    batch ends, which is at the latest its window's end (a batch read long after that is clamped to its retention)."""
    if output_expires_s is None:
        return retention_s
    return max(retention_s, parse_window(completion_window) + output_expires_s + OUTPUT_EXPIRY_MARGIN_S)


def check_metadata(metadata: dict | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_BATCH_METADATA_ITEMS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY_CHARS
            and len(v) <= MAX_METADATA_VALUE_CHARS for k, v in metadata.items()):
        raise BatchInputError(f"metadata has at most {MAX_BATCH_METADATA_ITEMS} string keys of up to "
                              f"{MAX_METADATA_KEY_CHARS} characters, with string values of up to "
                              f"{MAX_METADATA_VALUE_CHARS}")
    return dict(metadata)


def new_batch_id() -> str:
    return keys.BATCH_ID_PREFIX + uuid.uuid4().hex
