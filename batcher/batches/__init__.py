"""Batches: the jobs of one OpenAI batch file, tracked as one (status, counts, output files).

The package: `batch_object` (the Batch object, ids, windows), `ingest` (a batch file read as a stream and
enqueued), `store` (create, read, list, cancel, expire), `lines` (each request's outcome, and the rendered files),
`scripts` (the Lua scripts) and `file_store` (the uploaded files, OpenAI's Files API). Import from the module you
need: this file only explains.

Redis holds, per batch (every key is named in batcher/jobs/keys.py):
- `batcher:batch:<id>`: a hash with the Batch object's fields: status, counts, timestamps, metadata;
- `batcher:batch:<id>:custom_ids`: a list of the lines' custom_ids in input order;
- `batcher:batch:<id>:lines`: a hash, input index -> that request's output or error line;
- `batcher:feed:<id>`: the batch's completion feed (batcher/jobs/feed.py).
Job i of batch B has the id `B-i`, so the batch keeps no list of job ids: a queue or a registry is
searched for the batch's jobs by that prefix, and a job's index is in its own argument (BatchItem).

Counts are exact through crashes and retries: a job's outcome is written by one Lua script that runs
inside the transaction recording the job's result (`lines.record_outcome_on`, passed to
`rqbatcher.jobs.ends.record_end`). The script writes the line with
HSETNX, and counts it only if it was new, so whoever records an index first wins and a repeated or
late write (a retried job, a job stopped after its batch was cancelled) changes nothing. That is O(1)
Redis work per job, with no scan over the batch. The same script moves the batch to `completed` (or
`cancelled`) when the last line is written.

The same script adds a new output line's tokens to the batch's `usage`, and the step that ends a batch (in
any script) pushes its one webhook outbox event (scripts.py says how).

Output and error files are rendered from the stored lines in input order, streamed in chunks. They
live as long as the batch (`retention_s` from its creation), whatever RQ's result TTL is, or, with
`output_expires_after`, that long from the batch's end.

Cancel and expiry share one sweep: the batch's queued jobs are taken out of their queues in one pass
per queue, every index without a line gets a `batch_cancelled` (or `batch_expired`) error line, then
the running jobs get RQ's stop-job command (the worker aborts them within one step; their late
outcome is not counted). Expiry is enforced twice: each job carries the batch's deadline, which a
worker checks on admission, so an expired batch never costs a forward pass even if nobody looks at
it; and whoever reads the batch first after its deadline (a status poll, a listing, a gateway)
marks it `expired` and runs the sweep, so running jobs stop and the counts add up.
"""
