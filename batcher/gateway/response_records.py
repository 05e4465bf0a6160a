"""A stored response: what `GET /v1/responses/{id}`, its input items and `previous_response_id` read.

The record holds what the job does not: its tenant, when it was created, the fields it echoes and its input
items. Its output is its job's result (the job's id is the response id without `resp_`), which the gateway
enqueues with a result TTL as long as the record's retention, so the two expire together. Another tenant's
response is not found, as an unknown one is.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from redis import Redis

from rqbatcher.errors import BatcherError, InvalidName
from rqbatcher.jobs import keys
from rqbatcher.openai.responses.responses_body import RESPONSE_ID_PREFIX
from rqbatcher.schema import ChatMessage, GenerationRequest

DEFAULT_RESPONSE_RETENTION_S = 30 * 24 * 3600  # as OpenAI keeps stored responses


class ResponseNotFound(BatcherError, LookupError):
    """No such response for this tenant: never stored, deleted, expired, or another tenant's."""


class ResponseRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    tenant: str | None
    created_at: int
    model: str
    request: GenerationRequest
    echo: dict  # what the response object echoes that the request does not carry (responses_body.echo_fields)
    input_items: list[dict]

    @property
    def job_id(self) -> str:
        return self.id.removeprefix(RESPONSE_ID_PREFIX)

    @property
    def conversation(self) -> list[ChatMessage]:
        """Its messages without its instructions: what a response that continues it (previous_response_id)
        carries on, as OpenAI does (instructions are not carried over)."""
        return list(self.request.messages[0 if self.echo.get("instructions") is None else 1:])


class ResponseRecords:
    def __init__(self, connection: Redis, retention_s: int = DEFAULT_RESPONSE_RETENTION_S) -> None:
        self.connection, self.retention_s = connection, retention_s

    def save(self, record: ResponseRecord) -> None:
        self.connection.set(keys.response_key(record.id), record.model_dump_json(), ex=self.retention_s)

    def get(self, response_id: str, tenant: str | None) -> ResponseRecord:
        try:
            raw = self.connection.get(keys.response_key(response_id))
        except InvalidName:
            raw = None
        record = None if raw is None else ResponseRecord.model_validate_json(raw)
        if record is None or record.tenant != tenant:
            raise ResponseNotFound(f"No response found with id '{response_id}'.")
        return record

    def delete(self, response_id: str, tenant: str | None) -> ResponseRecord:
        record = self.get(response_id, tenant)
        self.connection.delete(keys.response_key(response_id))
        return record
