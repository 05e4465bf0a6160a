"""The systems `batcher bench` compares, named as on its command line (no torch here: the CLI checks names).

`batcher:continuous` and `batcher:static` are this engine, driven step by step; with the suffix `@redis`
they are served through Redis and a worker instead. `hf-cb`, `hf-static` and `hf-naive` are the
transformers baselines (`rqbatcher.workers.bench.peers`); `llama-server` is llama.cpp's server, built on first use
(`rqbatcher.workers.bench.llama_server`; not in ALL_SYSTEMS, which the tests run).

The systems with a prefix cache (batcher, and hf-cb with transformers' block sharing) run with it on, as
each ships; `:no-prefix-caching` after the name turns it off (`batcher:continuous:no-prefix-caching@redis`),
so one invocation can compare both. Likewise `:no-batch-invariant` (after it, batcher only) runs a batcher system
without batch-invariant bf16 kernels (docs/batch-invariance.md), so that one run measures what invariance costs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from rqbatcher.config import POLICIES, EngineConfig, Policy

REDIS_SUFFIX = "@redis"
NO_PREFIX_CACHING_SUFFIX = ":no-prefix-caching"
NO_BATCH_INVARIANT_SUFFIX = ":no-batch-invariant"
BATCHER_PREFIX = "batcher:"
PEERS = ("hf-cb", "hf-static", "hf-naive")
LLAMA_SERVER = "llama-server"

Kind = Literal["batcher", "hf-cb", "hf-static", "hf-naive", "llama-server"]
PREFIX_CACHING_KINDS = ("batcher", "hf-cb", LLAMA_SERVER)


@dataclass(frozen=True)
class System:
    kind: Kind
    policy: Policy | None = None  # batcher only
    through_redis: bool = False  # batcher only
    prefix_caching: bool = True  # batcher and hf-cb only: reuse the KV blocks of prompt prefixes computed before
    batch_invariant: bool = True  # batcher only: as the shared settings say, or off

    @classmethod
    def parse(cls, name: str) -> System:
        """`batcher:continuous`, `batcher:static:no-prefix-caching@redis`, `hf-cb`...; ValueError names the choices."""
        base = name.removesuffix(REDIS_SUFFIX)
        through_redis = base != name
        invariant = not base.endswith(NO_BATCH_INVARIANT_SUFFIX)
        base = base.removesuffix(NO_BATCH_INVARIANT_SUFFIX)
        caching = not base.endswith(NO_PREFIX_CACHING_SUFFIX)
        base = base.removesuffix(NO_PREFIX_CACHING_SUFFIX)
        peer = invariant and not through_redis and (caching or base in PREFIX_CACHING_KINDS)
        if base in (*PEERS, LLAMA_SERVER) and peer:
            return cls(base, prefix_caching=caching)
        policy = base.removeprefix(BATCHER_PREFIX)
        if base.startswith(BATCHER_PREFIX) and policy in POLICIES:
            return cls("batcher", policy, through_redis, caching, invariant)
        raise ValueError(f"unknown {name}; the systems are {', '.join(BASE_SYSTEMS)}; a batcher system may end "
                         f"with {REDIS_SUFFIX}, batcher and hf-cb systems take {NO_PREFIX_CACHING_SUFFIX}, and "
                         f"batcher systems {NO_BATCH_INVARIANT_SUFFIX} after it (both before {REDIS_SUFFIX})")

    @property
    def name(self) -> str:
        caching = "" if self.prefix_caching or self.kind not in PREFIX_CACHING_KINDS else NO_PREFIX_CACHING_SUFFIX
        if self.kind != "batcher":
            return self.kind + caching
        invariant = "" if self.batch_invariant else NO_BATCH_INVARIANT_SUFFIX
        return f"{BATCHER_PREFIX}{self.policy}{caching}{invariant}{REDIS_SUFFIX if self.through_redis else ''}"

    def via_redis(self) -> System:
        """The same system served through Redis and a worker (peers have no such path: unchanged)."""
        return replace(self, through_redis=True) if self.kind == "batcher" else self

    def without_prefix_caching(self) -> System:
        """The same system with its prefix cache off (systems without one: unchanged)."""
        return replace(self, prefix_caching=False) if self.kind in PREFIX_CACHING_KINDS else self

    def engine_config(self, shared: EngineConfig) -> EngineConfig:
        """The settings this system runs with: the shared ones, with its own policy and prefix caching (and batch
        invariance off if its name says so)."""
        return replace(shared, policy=self.policy or shared.policy, prefix_caching=self.prefix_caching,
                       batch_invariant=shared.batch_invariant and self.batch_invariant)

    def __str__(self) -> str:
        return self.name


BASE_SYSTEMS = tuple([f"{BATCHER_PREFIX}{p}" for p in POLICIES] + list(PEERS) + [LLAMA_SERVER])
ALL_SYSTEMS = tuple(
    [f"{BATCHER_PREFIX}{p}{c}{r}" for c in ("", NO_PREFIX_CACHING_SUFFIX) for r in ("", REDIS_SUFFIX) for p in POLICIES]
    + list(PEERS) + [f"hf-cb{NO_PREFIX_CACHING_SUFFIX}"])
