"""The transformers peers of `python -m benchmarks.compare`, each run on a plain model (SDPA attention).

- `hf-naive`: `generate` on one request at a time.
- `hf-static`: `generate` on left-padded groups of `slots` requests; each group runs to its longest
  request (EOS is ignored, as in the workload), and its shorter requests keep their first tokens.
- `hf-cb`: transformers' own continuous batching manager, with the engine's page size, block
  count, slots and token budget, and per-request `max_new_tokens`; its block sharing (transformers'
  prefix caching, on by default there) follows the system's prefix caching.

Token times: `generate` reports each step through a streamer; the manager records a timestamp
per token (`record_timestamps`). Both are taken when the token reaches the host, as in batcher.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.streamers import BaseStreamer

from rqbatcher.config import EngineConfig
from rqbatcher.workers.bench.record import PeakRss, SystemRun, by_arrival, wait_until
from rqbatcher.workers.bench.workload import WorkloadRequest
from rqbatcher.workers.engine.engine import WARMUP_REQUEST
from rqbatcher.workers.model.loading import resolve
from rqbatcher.workers.model.precision import DTYPES
from rqbatcher.workers.model.runner import resolve_device
from rqbatcher.workers.scheduler.blocks import blocks_needed

HF_ATTENTION = "sdpa"
PAD_TOKEN_ID = 0  # left padding is masked out, so any id works
NO_EOS = -1  # the manager's "no EOS" id; workloads generate exactly max_tokens
STEP_GAP_S = 1e-3  # hf-cb stamps one step's tokens microseconds apart; steps are milliseconds apart
RESULT_POLL_S = 0.05


def load_hf_model(config: EngineConfig) -> torch.nn.Module:
    """The same weights as the engine's, with transformers' own attention, on the engine's device."""
    model = AutoModelForCausalLM.from_pretrained(resolve(config.model), dtype=DTYPES[config.dtype],
                                                 attn_implementation=HF_ATTENTION)
    return model.to(resolve_device(config.device)).eval()


class _StepClock(BaseStreamer):
    """Stamps each decoding step: `generate` calls `put` once with the prompt, then once per step."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter() - self.start)
        self._prompt_seen = True

    def end(self) -> None:
        pass


@torch.inference_mode()
def _generate(model, prompts: list[list[int]], max_new_tokens: int,
              start: float) -> tuple[list[list[int]], list[float]]:
    """Greedy `generate` on a left-padded group; returns each row's new tokens and the step times."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD_TOKEN_ID] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    clock = _StepClock(start)
    # keyword arguments, not a GenerationConfig: a config's eos_token_id=None reads as "unset" and
    # the model's default EOS comes back, ending rows early
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=PAD_TOKEN_ID, streamer=clock)
    return out[:, width:].tolist(), clock.times


def _run_groups(name: str, model, workload: list[WorkloadRequest], vocab_size: int, slots: int) -> SystemRun:
    """Static batching with `generate`: take up to `slots` requests that have arrived, run them to
    the longest one, repeat."""
    run = SystemRun(name, slots=slots, token_times={w.id: [] for w in workload})
    _generate(model, [WARMUP_REQUEST.prompt_token_ids], WARMUP_REQUEST.sampling.max_tokens, time.perf_counter())
    pending = by_arrival(workload)
    with PeakRss() as rss:
        start = time.perf_counter()
        while pending:
            wait_until(start, pending[0].arrival_s)
            now = time.perf_counter() - start
            group = [w for w in pending[:slots] if w.arrival_s <= now]
            pending = pending[len(group):]
            longest = max(w.max_tokens for w in group)
            rows, times = _generate(model, [w.prompt_token_ids(vocab_size) for w in group], longest, start)
            for item, row in zip(group, rows):
                run.tokens[item.id] = row[: item.max_tokens]
                run.token_times[item.id] = times[: item.max_tokens]
            run.steps.extend((t, sum(w.max_tokens > i for w in group)) for i, t in enumerate(times))
        run.wall_s = time.perf_counter() - start
    run.peak_rss_bytes = rss.peak
    if slots > 1:
        run.notes.append(f"{name}: occupancy counts the rows that still want tokens; the others are padding")
    return run


def run_hf_naive(model, workload: list[WorkloadRequest], vocab_size: int) -> SystemRun:
    return _run_groups("hf-naive", model, workload, vocab_size, slots=1)


def lone_decode_gap_s(run: SystemRun) -> float | None:
    """hf-naive's decode step with one sequence: each gap between two of a request's tokens is one such step."""
    gaps = [b - a for times in run.token_times.values() for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def run_hf_static(model, workload: list[WorkloadRequest], vocab_size: int, slots: int) -> SystemRun:
    return _run_groups("hf-static", model, workload, vocab_size, slots=slots)


def workload_blocks(workload: list[WorkloadRequest], block_size: int) -> int:
    """KV blocks that hold every request of the workload at once: with that many, no system is
    short of cache (transformers' manager refuses the engine's default 1 GiB on small models)."""
    return sum(blocks_needed(w.prompt_len + w.max_tokens, block_size) for w in workload)


def cb_config(config: EngineConfig, num_blocks: int) -> ContinuousBatchingConfig:
    """The manager sized like the engine: page = block, the same slots, token budget and prefix caching."""
    return ContinuousBatchingConfig(page_size=config.block_size, num_blocks=num_blocks,
                                    max_batch_tokens=config.max_num_batched_tokens,
                                    max_requests_per_batch=config.max_num_seqs,
                                    allow_block_sharing=config.prefix_caching, use_cuda_graph=False,
                                    use_async_batching=False)


def _steps_from_stamps(run: SystemRun, lifespans: dict[str, tuple[float, float]]) -> None:
    """Rebuild hf-cb's steps: stamps closer than STEP_GAP_S belong to one step, and a step holds
    every request between its admission and its end (so prefill-only chunks count too)."""
    stamps = sorted(t for times in run.token_times.values() for t in times)
    ends = [b for a, b in zip(stamps, stamps[1:]) if b - a > STEP_GAP_S] + stamps[-1:]
    for t in ends:
        run.steps.append((t, sum(begin <= t <= end + STEP_GAP_S for begin, end in lifespans.values())))


def _check_running(manager) -> None:
    if not manager.is_running():
        raise RuntimeError("transformers' continuous batching manager stopped (its log above says why)")


@torch.inference_mode()
def run_hf_cb(model, workload: list[WorkloadRequest], vocab_size: int, config: EngineConfig,
              num_blocks: int, name: str) -> SystemRun:
    run = SystemRun(name, slots=config.max_num_seqs, token_times={w.id: [] for w in workload})
    generation = GenerationConfig(do_sample=False, eos_token_id=NO_EOS, pad_token_id=PAD_TOKEN_ID,
                                  max_new_tokens=max(w.max_tokens for w in workload))
    manager = model.init_continuous_batching(generation_config=generation,
                                             continuous_batching_config=cb_config(config, num_blocks))
    manager.start()
    try:
        manager.add_request(WARMUP_REQUEST.prompt_token_ids, request_id="warmup",
                            max_new_tokens=WARMUP_REQUEST.sampling.max_tokens, eos_token_id=NO_EOS)
        while manager.get_result(timeout=RESULT_POLL_S) is None:
            _check_running(manager)
        pending = by_arrival(workload)
        lifespans: dict[str, tuple[float, float]] = {}
        with PeakRss() as rss:
            start = time.perf_counter()
            while len(lifespans) < len(workload):
                now = time.perf_counter() - start
                while pending and pending[0].arrival_s <= now:
                    item = pending.pop(0)
                    manager.add_request(item.prompt_token_ids(vocab_size), request_id=item.id,
                                        max_new_tokens=item.max_tokens, record_timestamps=True, eos_token_id=NO_EOS)
                result = manager.get_result(timeout=RESULT_POLL_S)
                if result is None or not result.is_finished():
                    _check_running(manager)
                    continue
                if result.error:
                    raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
                run.tokens[result.request_id] = list(result.generated_tokens)
                run.token_times[result.request_id] = [t - start for t in result.timestamps]
                lifespans[result.request_id] = (result.lifespan[0] - start, result.lifespan[1] - start)
            run.wall_s = max(end for _, end in lifespans.values())
    finally:
        manager.stop(block=True)
    run.peak_rss_bytes = rss.peak
    _steps_from_stamps(run, lifespans)
    run.notes.append(f"{name}: steps and slot occupancy are rebuilt from per-token timestamps and request "
                     "lifespans (an approximation); token times are exact")
    if config.prefix_caching:
        run.notes.append(f"{name}: transformers' block sharing is on but does not report its prefix hits, so its "
                         "MFU counts every prompt token as computed")
    return run
