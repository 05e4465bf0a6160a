"""How to pick tokens and when to stop: a request's sampling parameters (pydantic, no torch)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

MAX_TOKENS_LIMIT = 1 << 15
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
DEFAULT_MAX_TOKENS = 256
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16
MAX_LOGIT_BIAS_ENTRIES = 1024  # OpenAI documents no limit; a bound keeps one request from costing every step much
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's: -100 bans a token, 100 makes it all but certain
PENALTY_LIMIT = 2.0  # frequency and presence penalties lie in [-2, 2], as OpenAI's do


def _token_id_key(value):
    """A logit_bias key: a token id, or its decimal digits (JSON's keys are text: OpenAI's `{"50256": -100}`)."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return value


TokenIdKey = Annotated[int, BeforeValidator(_token_id_key)]


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop. `temperature=0` is greedy decoding. An unknown field is an error, and so
    is a value of another type (`"4"` is not 4, `true` is not 1, 2.0 is not an integer): see rqbatcher.schema."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=0, le=MAX_TOKENS_LIMIT, description="0: the prompt alone (echo)")
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1 << 20, description="0 turns top-k off")
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64, description="any int64 or uint64, as clients send")
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="report each token's logprob and this many most likely alternatives")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="answers to generate for the prompt, each with its own seed")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES,
                                description="generate this many (at least n) and return the n whose tokens have the "
                                            "highest mean logprob")
    frequency_penalty: float = Field(0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT,
                                     description="subtracted from a token's logit once per time it was generated")
    presence_penalty: float = Field(0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT,
                                    description="subtracted from a token's logit once if it was generated")
    logit_bias: dict[TokenIdKey, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS_ENTRIES,
                                         description="token id -> added to its logit, from -100 to 100")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_strings_sane(cls, value: list[str]) -> list[str]:
        for s in value:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _biases_bounded(cls, value: dict[int, float]) -> dict[int, float]:
        for token, bias in value.items():
            if not 0 <= token < 1 << 31:
                raise ValueError(f"token id {token} is not a token id (ids are in [0, 2**31))")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"the bias of token {token} is {bias}; biases lie in [-100, 100]")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_covers_n(cls, value: int | None, info) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value < n:
            raise ValueError(f"best_of ({value}) must be at least n ({n})")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def candidates(self) -> int:
        """How many answers are generated: best_of when given, else n."""
        return self.best_of or self.n
