"""The engine: `add`, `step`, `abort`, `has_work` (`rqbatcher.workers.engine.api.EngineProtocol`). It knows nothing
of Redis and holds no sequence state of its own: each step is glue between the parts,

    tokenize (on add) -> Scheduler.schedule -> ModelRunner.execute -> Sampler.sample
        -> Scheduler.update -> detokenize (and stop strings)

and returns what changed for each request: new tokens and text, the request's times, and a finish reason
when it is done. Plain data crosses the boundary: `add` returns nothing, outputs are copies, and `stats()` is a
snapshot, so no one outside holds a live sequence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from rqbatcher.config import TASK_EMBED, TASK_GENERATE, EngineConfig
from rqbatcher.logit_bias import logit_bias_problem
from rqbatcher.schema import GenerationRequest, SamplingParams, TokenLogprob
from rqbatcher.service_class import CLASSES, class_of, urgency_of
from rqbatcher.workers.engine.api import EngineStats, Progress, RequestError, RequestOutput, StepStats
from rqbatcher.workers.engine.chat_format import chat_format_of
from rqbatcher.workers.engine.choices import Choices
from rqbatcher.workers.engine.detokenize import IncrementalDetokenizer
from rqbatcher.workers.engine.embeddings import Embeddings, serving_tasks
from rqbatcher.workers.engine.logprobs import Logprobs
from rqbatcher.workers.engine.prompt_ids import prompt_ids
from rqbatcher.workers.engine.sampling import Sampler
from rqbatcher.workers.engine.structured import Grammars
from rqbatcher.workers.model.loading import LoadedModel
from rqbatcher.workers.model.runner import ModelRunner
from rqbatcher.workers.scheduler import Scheduler, StepPlan
from rqbatcher.workers.scheduler.blocks import BlockAllocator, blocks_needed
from rqbatcher.workers.scheduler.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)

# One tiny request run before serving or timing keeps first-call costs (allocations, lazy init) out of both.
WARMUP_REQUEST = GenerationRequest(prompt_token_ids=[100] * 16, sampling=SamplingParams(max_tokens=2, ignore_eos=True))
WARMUP_EMBED_REQUEST = GenerationRequest(embed=[[100] * 16])  # on a worker that only embeds
WARMUP_REQUEST_ID = "warmup"
RECENT_STEP_WEIGHT = 0.1  # of the latest step in `recent_step_s`: a moving average over about ten steps


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    new_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    logprobs: list[TokenLogprob] | None = None  # all of them, when the request asked
    new_logprobs: list[TokenLogprob] = field(default_factory=list)


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.chat_format = chat_format_of(loaded.tokenizer)  # how its answers write calls and reasoning
        self.runner = ModelRunner(loaded, config)
        limits = [v for v in (config.max_model_len, loaded.max_position_embeddings) if v]
        self.max_model_len = min(limits) if limits else 1 << 20
        allocator = BlockAllocator(self.runner.num_blocks, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(config, allocator, loaded.eos_token_ids, self.max_model_len)
        self.sampler = Sampler(self.runner.device)
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids, self.chat_format)
        self.logprobs = Logprobs(loaded.tokenizer)
        self.choices = Choices()
        self.tasks = serving_tasks(config.tasks, loaded.embedding, loaded.name)
        self.embeddings = Embeddings(loaded, self.max_model_len, allocator.num_blocks * config.block_size)
        self.step_index = 0
        self.last_step: StepStats | None = None
        self.recent_step_s = 0.0
        self._requests: dict[str, _Request] = {}
        self._ready: list[RequestOutput] = []  # ends of resumed choices that had ended before: the next step's

    # ----- the public API -----
    def add(self, request_id: str, request: GenerationRequest, arrival_time: float | None = None,
            progress: dict[int, Progress] | None = None) -> None:
        """Queue a request. Raises RequestError, and keeps nothing, if it can never be served.

        `progress` (by choice) is what an earlier attempt generated: those tokens join the sequence as generated,
        so its first step prefills prompt + them (the prefix cache may hold the prompt) and decoding goes on with
        what is left of `max_tokens`. Its detokenizer, stop strings, grammar and logprobs are brought to where the
        earlier attempt left them; a choice that had already ended is reported ended by the next step."""
        if request_id in self._requests or request_id in self.choices or request_id in self.embeddings:
            raise RequestError(f"request id {request_id!r} is already in the engine")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if request.tokenize_only:  # answered by the next step, with no forward and no slot: any worker can count
            self._ready += [RequestOutput.tokenized(request_id, request, self.tokenize(request), self.loaded, arrival)]
            return
        task = TASK_GENERATE if request.embed is None else TASK_EMBED
        if task not in self.tasks:
            raise RequestError(f"this worker does not serve {task} jobs: it serves {', '.join(self.tasks)} "
                               f"with model {self.loaded.name!r}")
        if request.embed is not None:  # one prefill-only sequence per input
            for seq in self.embeddings.add(request_id, request, arrival):
                self.scheduler.add(seq)
            return
        prompt_ids = self.tokenize(request)
        self._check_servable(prompt_ids, request)
        sequences = self.choices.expand(request_id, request)  # one per choice (n) or candidate (best_of)
        requests, ends = [], []  # ends: the reason of a choice that had ended in the earlier attempt
        try:
            for i, (sequence_id, sampling) in enumerate(sequences):
                self.grammars.admit(sequence_id, request)
                prior = (progress or {}).get(i)
                seq = Sequence(sequence_id, prompt_ids, sampling, arrival_time=arrival,
                               service_class=class_of(request), urgency=urgency_of(request), tenant=request.tenant,
                               resumed_token_ids=prior.token_ids if prior else None,
                               prompt_logprobs=request.prompt_logprobs)
                markers = self.grammars.markers_of(request)  # the call markers its grammar writes, kept as text
                detok = IncrementalDetokenizer(self.loaded.tokenizer, prompt_ids, sampling.stop, markers)
                req = _Request(seq, detok, logprobs=None if sampling.logprobs is None else [])
                requests.append(req)
                ends.append(self._restore(req, prior) if prior and prior.token_ids else None)
        except RequestError:
            for sequence_id, _ in sequences:
                self.grammars.forget(sequence_id)
            raise
        for req, end in zip(requests, ends):
            self._requests[req.seq.request_id] = req
            self.sampler.admit(req.seq)
            if end is None:
                self.scheduler.add(req.seq)
        self.choices.register(request_id, [sequence_id for sequence_id, _ in sequences], request.sampling)
        for req, end in zip(requests, ends):
            if end is not None:
                req.delta_text = req.detokenizer.flush()  # what the earlier attempt still held back
                self._ready.append(self._finish(req, end))

    def has_work(self) -> bool:
        return bool(self._ready) or self.scheduler.has_work()

    @property
    def free_slots(self) -> int:
        """How many more requests could join without waiting for a slot."""
        return self.scheduler.free_slots

    @property
    def urgent_room(self) -> int:
        """How many priority or interactive requests could join beyond the free slots, each to preempt batch work."""
        return self.scheduler.urgent_room

    @property
    def fair_room(self) -> int:
        """How many interactive requests of a tenant holding no slot could join beyond the free slots (0 or 1)."""
        return self.scheduler.fair_room

    @property
    def batch_deficit(self) -> int:
        """How many batch requests to take before any other: what batch work lacks of its minimum share."""
        return self.scheduler.batch_deficit

    @property
    def dtype(self) -> str:
        """The dtype the model runs in (never "auto": `build_engine` resolves it)."""
        return self.config.dtype

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state, for metrics and the worker's published figures."""
        scheduler, facts, embeds = self.scheduler, self.loaded.embedding, TASK_EMBED in self.tasks
        return EngineStats(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                           free_slots=scheduler.free_slots, kv_cache_usage=scheduler.allocator.usage,
                           prefix_cache=replace(scheduler.prefix_cache_stats), dtype=self.dtype,
                           quantization=self.config.quantization,
                           last_step=self.last_step, urgency_preemptions=dict(scheduler.urgency_preemptions),
                           fairness_preemptions=scheduler.fairness_preemptions,
                           step_time_target_s=scheduler.budget.step_target_s, recent_step_s=self.recent_step_s,
                           prefix_blocks_awaited=scheduler.prefix_blocks_awaited, max_model_len=self.max_model_len,
                           vocab_size=self.loaded.vocab_size, tasks=",".join(self.tasks),
                           embedding_size=facts.size if embeds else 0,
                           matryoshka_dimensions=facts.matryoshka if embeds else "")

    def warm_up(self) -> None:
        """Run one tiny request to the end, before serving or timing anything."""
        self.add(WARMUP_REQUEST_ID, WARMUP_REQUEST if TASK_GENERATE in self.tasks else WARMUP_EMBED_REQUEST)
        while self.has_work():
            self.step()

    def abort(self, request_id: str, reason: str = "cancelled") -> RequestOutput | None:
        """End a request now, keeping what it generated. None if the engine does not hold it."""
        if request_id in self.embeddings:
            return self._end_embedding(request_id, reason=reason)
        outputs = []
        for sequence_id in self.choices.live(request_id):
            req = self._requests.get(sequence_id)
            if req is not None:
                req.delta_text += req.detokenizer.flush()
                outputs.append(self._finish(req, reason))
        merged = self.choices.merge(outputs, self.abort)
        return merged[-1] if merged else None

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, update; return an output for every request that changed."""
        started = time.perf_counter()
        ready, self._ready = self._ready, []
        plan = self.scheduler.schedule()
        if not plan:
            return self.choices.merge(ready, self.abort)
        computed, sampled, outputs = self._run(plan)
        outputs = ready + outputs
        finished = set(self.scheduler.update(computed, sampled))
        outputs += [out for seq in finished if seq.embed and (out := self.embeddings.finish(seq)) is not None]
        outputs += [self._finish(self._requests[s.request_id], "length") for s in finished if s.scores_prompt_only]
        for seq, token in sampled.items():
            req = self._requests[seq.request_id]
            try:
                outputs.append(self._accept(req, token, seq in finished))
            except Exception as exc:  # one request's post-processing must not take down the others
                log.exception("request %s failed after sampling", seq.request_id)
                outputs.append(self._fail(req, f"{type(exc).__name__}: {exc}"))
        duration_s = time.perf_counter() - started
        self.scheduler.record_step(computed, duration_s)
        self.recent_step_s += RECENT_STEP_WEIGHT * (duration_s - self.recent_step_s)
        budget = self.scheduler.budget
        classes = {s.service_class for s in plan.num_tokens}
        self.last_step = StepStats(
            step=self.step_index, num_seqs=len(plan.num_tokens), num_tokens=plan.total_tokens,
            num_prefill_tokens=sum(n for n in plan.num_tokens.values() if n > 1), num_preempted=len(plan.preempted),
            duration_s=duration_s, mix="+".join(c for c in CLASSES if c in classes),
            prompt_token_budget=int(min(budget.prompt_tokens, self.config.max_num_batched_tokens)),
            urgent_prompt_tokens=budget.urgent_tokens,
            batch_prompt_tokens=budget.batch_tokens,
            target_infeasible=budget.infeasible,
        )
        self.step_index += 1
        return self.choices.merge(outputs, self.abort)

    # ----- helpers -----
    def tokenize(self, request: GenerationRequest) -> list[int]:
        return prompt_ids(request, self.loaded.tokenizer, self.loaded.name)

    def _restore(self, req: _Request, prior: Progress) -> str | None:
        """Bring a new sequence's helpers to where an earlier attempt left it: its generated tokens replayed through
        the detokenizer (stop strings) and the grammar, its logprobs kept. Returns the finish reason if it had
        already ended there."""
        seq = req.seq
        for token in prior.token_ids:
            req.detokenizer.push(token)
        if req.logprobs is not None:
            req.logprobs.extend(prior.logprobs or [])
        grammar_complete = self.grammars.advance(seq)
        eos = prior.token_ids[-1] in self.loaded.eos_token_ids and not seq.sampling.ignore_eos
        if req.detokenizer.stopped or grammar_complete or eos:
            return "stop"
        if seq.num_output_tokens >= seq.sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _check_servable(self, prompt_ids: list[int], request: GenerationRequest) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                               f"{self.max_model_len} (max_model_len), with room needed for at least one new token")
        bad = next((t for t in prompt_ids if t >= self.loaded.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (size {self.loaded.vocab_size})")
        if (problem := logit_bias_problem(request.sampling, self.loaded.vocab_size)) is not None:
            raise RequestError(problem)
        longest = min(len(prompt_ids) + request.sampling.max_tokens, self.max_model_len)
        allocator = self.scheduler.allocator
        if blocks_needed(longest, allocator.block_size) > allocator.num_blocks:
            raise RequestError(f"the request may need {longest} tokens of KV cache; the whole cache holds "
                               f"{allocator.num_blocks * allocator.block_size}")

    def _run(self, plan: StepPlan) -> tuple[StepPlan, dict[Sequence, int], list[RequestOutput]]:
        """Run the plan; if the forward raises, rerun each sequence alone and fail only the culprits.

        Returns the part of the plan that was computed, the token each of its sampling sequences drew, and the
        outputs of the sequences that failed."""
        try:
            return plan, self._forward(plan), []
        except Exception as exc:
            if len(plan.num_tokens) == 1:
                seq = next(iter(plan.num_tokens))
                log.exception("request %s failed in the forward", seq.request_id)
                failed = self._fail_sequence(seq, f"{type(exc).__name__}: {exc}")
                return StepPlan(preempted=plan.preempted), {}, [failed]
            log.warning("a step of %d sequences failed (%s); isolating the culprit", len(plan.num_tokens), exc)
        computed, sampled, failures = StepPlan(preempted=plan.preempted), {}, []
        for seq, n in plan.num_tokens.items():
            if seq.status is not SequenceStatus.RUNNING:  # it started from blocks a failed sequence never filled
                computed.preempted.append(seq)
                continue
            part, part_sampled, part_failures = self._run(StepPlan({seq: n}))
            computed.num_tokens.update(part.num_tokens)
            sampled.update(part_sampled)
            failures += part_failures
        return computed, sampled, failures

    @torch.inference_mode()
    def _forward(self, plan: StepPlan) -> dict[Sequence, int]:
        self.grammars.begin(plan)
        logits, seqs = self.runner.execute(plan)
        self.grammars.mask(logits, seqs)  # first: a bias or penalty added later leaves -inf at -inf
        captured = self.logprobs.capture(logits, seqs, self.runner.prompt_logits)  # before the sampler's changes
        tokens = self.sampler.sample(logits, seqs)
        self.logprobs.record(captured, seqs, tokens)
        for seq, rows in self.runner.embedding_rows.items():  # last: a step that failed before pools nothing
            self.embeddings.pool(seq, rows)
        return dict(zip(seqs, tokens))

    def _accept(self, req: _Request, token: int, finished: bool) -> RequestOutput:
        """Detokenize the token the scheduler took; a stop string or a complete grammar ends the request here."""
        seq = req.seq
        grammar_complete = self.grammars.advance(seq)
        req.new_token_ids.append(token)
        if (logprob := self.logprobs.pop(seq.request_id)) is not None:
            req.new_logprobs.append(logprob)
            req.logprobs.append(logprob)
        req.delta_text += req.detokenizer.push(token)
        if req.detokenizer.stopped or grammar_complete:
            self.scheduler.finish(seq, "stop")  # a stop string or a complete grammar names the reason, even last
            finished = True
        if finished:
            req.delta_text += req.detokenizer.flush()
            self._forget(req)
            return self._emit(req, finish_reason=seq.finish_reason)
        return self._emit(req)

    def _emit(self, req: _Request, finish_reason: str | None = None, error: str | None = None) -> RequestOutput:
        seq = req.seq
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=req.new_token_ids,
            delta_text=req.delta_text,
            text=req.detokenizer.text,
            token_ids=seq.output_token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            finish_reason=finish_reason,
            stop_sequence=req.detokenizer.matched if finish_reason else None,
            error=error,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            last_token_time=seq.last_token_time,
            new_logprobs=None if req.logprobs is None else req.new_logprobs,
            logprobs=None if req.logprobs is None else list(req.logprobs),
            **(self.logprobs.prompt_part(seq) if finish_reason or error else {}),
        )
        req.new_token_ids, req.delta_text, req.new_logprobs = [], "", []
        return out

    def _finish(self, req: _Request, reason: str) -> RequestOutput:
        self.scheduler.finish(req.seq, reason)
        self._forget(req)
        return self._emit(req, finish_reason=reason)

    def _fail(self, req: _Request, error: str) -> RequestOutput:
        self.scheduler.finish(req.seq, "error")
        self._forget(req)
        return self._emit(req, error=error)

    def _end_embedding(self, request_id: str, reason: str | None = None, error: str | None = None) -> RequestOutput:
        out, live = self.embeddings.end(request_id, reason, error)
        for seq in live:
            self.scheduler.finish(seq, reason or "error")
        return out

    def _fail_sequence(self, seq: Sequence, error: str) -> RequestOutput:
        """Fail the request of a sequence whose forward raised (an embedding input fails its whole request)."""
        if seq.embed:
            return self._end_embedding(self.embeddings.request_of(seq), error=error)
        return self._fail(self._requests[seq.request_id], error)

    def _forget(self, req: _Request) -> None:
        """Drop the engine's per-request helpers of a sequence the scheduler has finished."""
        self.sampler.forget(req.seq.request_id)
        self.grammars.forget(req.seq.request_id)
        self.logprobs.pop(req.seq.request_id)
        del self._requests[req.seq.request_id]


def build_engine(config: EngineConfig) -> Engine:
    """Load `config.model` and build an engine around it, with `dtype="auto"` resolved (and logged)."""
    from rqbatcher.workers.model.loading import load_model
    from rqbatcher.workers.model.precision import DTYPES, resolve_dtype
    from rqbatcher.workers.model.runner import resolve_device

    torch.set_grad_enabled(False)
    config = replace(config, dtype=resolve_dtype(config.dtype, resolve_device(config.device)))
    return Engine(load_model(config.model, DTYPES[config.dtype]), config)
