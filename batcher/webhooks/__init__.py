"""Signed webhooks: the end of a batch or a background response, announced to its tenant's HTTP endpoints.

The package: `endpoints` (each tenant's endpoints and their signing secrets, in Redis), `event_payload` (the event
types, ids and bodies, in OpenAI's event shape), `signing` (Standard Webhooks signatures, which the `openai` SDK's
`client.webhooks.unwrap` verifies), `addresses` (which hosts a delivery may reach), `pinned_http` (a POST to the
address that was checked), `outbox` (`dispatch`: outbox entries become delivery jobs), `delivery` (the RQ job that
POSTs one event to one endpoint) and `delivery_worker` (`batcher webhooks worker`). Import from the module you need.

The flow: whoever records an end pushes an entry onto the outbox (`keys.WEBHOOK_OUTBOX`) in the same transaction, so
no end is announced that did not happen and none that happened is lost. `dispatch` turns each entry into one
ordinary RQ job per matching endpoint on the `webhooks` queue, with retries spread over more than a day; any RQ
worker with a scheduler on that queue runs them (a model worker never does). Delivery is at least once: a
receiver drops repeats by the `webhook-id` header, the same on every attempt.
"""
