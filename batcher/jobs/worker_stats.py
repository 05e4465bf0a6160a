"""The figures a worker publishes with every heartbeat, and `batcher workers` reads: one contract, both sides.

The worker writes `WorkerStats.to_dict()` to `keys.worker_stats_key(name)` (expiring when it dies) and adds its
name to `keys.WORKERS_SET`; `rqbatcher.jobs.admin.list_workers` reads them back with `WorkerStats.from_hash`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from typing import Literal

from rqbatcher.config import DEFAULT_QUANTIZATION
from rqbatcher.jobs.redis_text import as_text

WorkerState = Literal["idle", "busy", "suspended", "draining"]


@dataclass(frozen=True)
class WorkerStats:
    name: str
    host: str
    pid: int
    queues: str  # the base queues it serves, comma-separated
    model: str
    state: WorkerState
    in_flight: int
    free_slots: int
    kv_usage: float  # fraction of KV-cache blocks in use
    tokens_per_s: float  # generated since the previous heartbeat
    last_heartbeat: float  # time.time()
    dtype: str = "unknown"  # what the model runs in (`--dtype auto` resolved)
    quantization: str = DEFAULT_QUANTIZATION  # its linears' weights: none (in dtype) or int8 (`--quantization`)
    prefix_cache_hit_rate: float = 0.0  # prompt tokens found in the prefix cache, over those looked up, since start
    in_flight_by_class: str = ""  # e.g. "interactive=2,batch=30" (batcher/service_class.py)
    step_time_target_s: float = 0.0  # the last step's, given or measured (workers/scheduler/step_budget.py); 0: none
    step_target_infeasible: int = 0  # 1: the given target is below what the decodes alone cost; the measured one runs
    urgent_prompt_tokens: int = 0  # prompt tokens the last step gave to priority and interactive work
    batch_prompt_tokens: int = 0  # and to batch work
    prefix_blocks_awaited: int = 0  # since start: blocks requests waited for another's prefill to fill, not computed
    step_s: float = 0.0  # the engine's recent step time, measured (a moving average)
    vocab_size: int = 0  # its model's; the gateway refuses a logit_bias id past it (batcher/logit_bias.py); 0: unknown
    tasks: str = "generate"  # what it serves, comma-separated: generate, embed (`--task`, or its model's config)
    embedding_size: int = 0  # the length of its embeddings (its model's hidden size); 0: it does not embed
    matryoshka_dimensions: str = ""  # other lengths it can shorten them to: "" none, "any", or a comma-separated list
    max_model_len: int = 0  # its context: the most tokens a sequence holds (what /tokenize reports); 0: unknown

    @property
    def heartbeat_age_s(self) -> float:
        return max(0.0, time.time() - self.last_heartbeat)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hash(cls, raw: dict) -> WorkerStats:
        """Parse a hash as redis-py returns it (bytes or str): a worker publishes every field at once, so a hash
        that lacks one is not a worker's."""
        text = {as_text(k): as_text(v) for k, v in raw.items()}
        missing = [f.name for f in fields(cls) if f.name not in text]
        if missing:
            raise ValueError(f"not a worker's stats: the hash lacks {', '.join(missing)}")
        return cls(**{f.name: {"int": int, "float": float}.get(f.type, str)(text[f.name]) for f in fields(cls)})
