"""Constrained decoding in the engine: each constrained sequence's grammar state, and the token mask.

The engine calls five hooks, none of which costs anything while no sequence is constrained:
- `admit` at `Engine.add`: compile the request's grammar (batcher/constraints.py) against the tokenizer,
  from a cache keyed by the grammar, within COMPILE_TIMEOUT_S (past it, that request alone fails);
- `begin` before the forward: on the mask thread, llguidance fills one bitmask row per constrained sequence
  that samples this step (without the GIL), unpacked into a [rows, vocab] bool, while the forward runs;
- `mask` between the forward and the sampler: waits for those rows, and one vectorised op sends every
  token the grammars forbid to -inf;
- `advance` when the scheduler took a sampled token: the grammar state consumes the sequence's output
  tokens it has not seen, and says when the grammar is complete (the answer then ends with `stop`, as at
  a stop string). It is driven by the output tokens alone, so a fresh state replays them; a preempted
  sequence keeps its state, since recomputation does not change its output;
- `forget` when the request ends.

A grammar that may go on (an array below its maxItems) allows EOS where it may end; one that is complete
ends the answer at once. A cut by `max_tokens` ends it with `length` as usual.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import llguidance
import torch

from rqbatcher.schema import ChatFormat, GenerationRequest
from rqbatcher.workers.engine.api import RequestError
from rqbatcher.workers.engine.reasoning_probe import special_marker_ids
from rqbatcher.workers.engine.tool_format_probe import served_tool_format
from rqbatcher.workers.scheduler import StepPlan
from rqbatcher.workers.scheduler.sequence import Sequence

COMPILE_TIMEOUT_S = 2.0
COMPILE_THREADS = 2  # a compile past its bound keeps its thread until llguidance's own limits stop it
COMPILE_CACHE_SIZE = 128
BITS = 32  # tokens per bitmask word
BITS_PER_BYTE = 8


def compile_grammar(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher at the start of `grammar` (llguidance compiles as it builds one, without the GIL)."""
    return llguidance.LLMatcher(tokenizer, grammar, log_level=0)


@dataclass
class GrammarState:
    matcher: llguidance.LLMatcher
    consumed: int = 0  # output tokens the matcher has seen


class Grammars:
    """The grammars of one engine's constrained sequences, keyed by request id."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 chat_format: ChatFormat = ChatFormat()) -> None:
        self._hf_tokenizer = tokenizer
        self.tool_format = served_tool_format(tokenizer, chat_format.tools)  # calls are written in the model's format
        self.reasoning_format = chat_format.reasoning  # a constrained answer starts after the reasoning
        self._reasoning_markers = special_marker_ids(tokenizer, chat_format.reasoning)
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (about a second)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._states: dict[str, GrammarState] = {}
        self._compiler = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
        self._words = (vocab_size + BITS - 1) // BITS
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._pending: tuple[list[Sequence], Future] | None = None  # the masks `begin` started
        self._shifts = torch.arange(BITS_PER_BYTE, dtype=torch.uint8)

    def admit(self, request_id: str, request: GenerationRequest) -> None:
        """Compile the request's grammar (if it has one) and give it a fresh state; RequestError if it cannot."""
        try:
            grammar = request.grammar(self.reasoning_format, tool_format=self.tool_format)
        except ValueError as exc:  # a job validated by an older client, or built without validation
            raise RequestError(str(exc)) from None
        if grammar is not None:
            self._states[request_id] = GrammarState(self._compile(grammar).deep_copy())

    def markers_of(self, request: GenerationRequest) -> tuple[int, ...]:
        """The special tokens the request's answer is read by (its calls' markers, the reasoning's): the detokenizer
        keeps them."""
        calls = tuple(self.tool_format.special_ids.values()) if request.calls_tools else ()
        return calls + self._reasoning_markers

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def advance(self, seq: Sequence) -> bool:
        """Feed the sequence's new output tokens to its grammar; True once the grammar is complete (the answer
        ends there). RequestError if the grammar refuses a token."""
        state = self._states.get(seq.request_id)
        if state is None:
            return False
        matcher = state.matcher
        for token in seq.output_token_ids[state.consumed:]:
            state.consumed += 1
            if matcher.is_stopped():  # only an EOS can follow a complete grammar
                break
            if not matcher.consume_token(token) or matcher.is_error():
                raise RequestError(f"the answer left its grammar: {matcher.get_error()}")
        return matcher.is_stopped()

    def begin(self, plan: StepPlan) -> None:
        """Start computing the masks of the constrained sequences that sample in `plan`, on the mask thread,
        while the forward runs (llguidance drops the GIL): a step then waits only for what is left of it."""
        if self._pending is not None:  # begun for a forward that raised: let it end before touching its matchers
            wait([self._pending[1]])
            self._pending = None
        if not self._states:
            return
        seqs = [seq for seq in plan.num_tokens if seq.request_id in self._states and plan.samples(seq)]
        self._pending = (seqs, self._mask_thread.submit(self._forbidden, seqs)) if seqs else None

    def mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Send the logits of tokens that the grammars forbid to -inf, in place (row i is `seqs[i]`)."""
        if self._pending is None:
            return
        (begun, future), self._pending = self._pending, None
        forbidden = future.result()
        position = {seq.request_id: j for j, seq in enumerate(begun)}
        rows = [i for i, seq in enumerate(seqs) if seq.request_id in position]
        order = [position[seqs[i].request_id] for i in rows]
        if order != list(range(len(begun))):
            forbidden = forbidden[order]
        forbidden = forbidden.to(logits.device)
        if len(rows) == len(seqs):  # every row constrained: one in-place pass over the logits
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            logits[index] = logits[index].masked_fill(forbidden, float("-inf"))

    # ----- helpers -----
    def _forbidden(self, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs), vocab] bool, True where a sequence's grammar forbids the token (on the mask thread)."""
        for seq in seqs:
            self.advance(seq)
        bitmask = torch.empty((len(seqs), self._words), dtype=torch.int32)
        matchers = [(self._states[seq.request_id].matcher, j) for j, seq in enumerate(seqs)]
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), self._words * bitmask.element_size(),
                                               len(seqs))
        as_bytes = bitmask.view(torch.uint8)  # token t is bit t%8 of byte t//8 (little-endian words)
        return ((as_bytes.unsqueeze(-1) >> self._shifts) & 1).view(len(seqs), -1)[:, :self.vocab_size] == 0

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        """The compiled grammar (a matcher at its start, copied for each sequence), from the cache if there."""
        compiled = self._compiled.get(grammar)
        if compiled is not None:
            self._compiled.move_to_end(grammar)
            return compiled
        tokenizer = self._llg_tokenizer()
        future = self._compiler.submit(compile_grammar, tokenizer, grammar)
        try:
            compiled = future.result(timeout=COMPILE_TIMEOUT_S)
        except FutureTimeout:
            raise RequestError(f"the answer's grammar (response_format, regex, choice or tools) took more than "
                               f"{COMPILE_TIMEOUT_S:g} s to compile; simplify the schema") from None
        if compiled.is_error():
            raise RequestError(f"the answer's grammar cannot be compiled: {compiled.get_error()}")
        self._compiled[grammar] = compiled
        if len(self._compiled) > COMPILE_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self._eos or None)
            except Exception as exc:  # noqa: BLE001  (a slow or odd tokenizer: no constraints on this model)
                raise RequestError(f"this model's tokenizer cannot run constrained decoding: {exc}") from None
        return self._tokenizer
