"""`batcher run`: an OpenAI-format batch file through the engine, without Redis. Its lines may be of every batch
endpoint (batcher/openai/batch_endpoints.py); each output line's id is its line's (`line-<index>`).

A bad line becomes an error line and the rest of the file still runs; results keep input order.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from rqbatcher.openai.batch_endpoints import output_line, parse_line
from rqbatcher.openai.batch_lines import BatchLineError, error_line
from rqbatcher.schema import BatchItem, GenerationRequest, Timings
from rqbatcher.tools.calls import answer_format
from rqbatcher.workers.engine.api import RequestError
from rqbatcher.workers.engine.engine import Engine

OFFLINE_BATCH = "offline"  # the BatchItem's batch: no batch in Redis holds these lines


def run_batch(engine: Engine, lines: Iterable[str], on_done: Callable[[], None] = lambda: None) -> list[dict]:
    """Run every non-blank line; return one output dict per line, in input order."""
    results: list[dict | None] = []
    pending: dict[str, tuple[int, str | None, GenerationRequest]] = {}
    for line in lines:
        if not line.strip():
            continue
        index = len(results)
        results.append(None)
        try:
            custom_id, request, item_fields = parse_line(line)
            request = request.model_copy(update={"batch": BatchItem(id=OFFLINE_BATCH, index=index,
                                                                    custom_id=custom_id, **item_fields)})
            engine.add(f"line-{index}", request)
            pending[f"line-{index}"] = (index, custom_id, request)
        except BatchLineError as exc:
            results[index] = error_line(exc.custom_id, str(exc))
            on_done()
        except RequestError as exc:
            results[index] = error_line(custom_id, str(exc))
            on_done()
    started = time.monotonic()
    while engine.has_work():
        for out in engine.step():
            if not out.finished:
                continue
            index, custom_id, request = pending.pop(out.request_id)
            if out.error:
                results[index] = error_line(custom_id, out.error, code="generation_failed")
            else:
                result = out.to_result(Timings(total_s=time.monotonic() - started), model=engine.loaded.name,
                                       chat_format=answer_format(request, engine.chat_format))
                results[index] = output_line(custom_id, result, request, job_id=out.request_id,
                                             created=int(time.time()))
            on_done()
    return results
