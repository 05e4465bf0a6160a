"""The systems `batcher bench` runs, named as on its command line (no torch here: the CLI checks names).

`batcher:continuous` and `batcher:static` are this engine, driven step by step in this process; with the suffix
`@redis` they are served through Redis and a worker instead. Each runs with its prefix cache on, as it ships;
`:no-prefix-caching` after the name turns it off (`batcher:continuous:no-prefix-caching@redis`), so one invocation
can compare both. Likewise `:no-batch-invariant` (after it) runs without batch-invariant bf16 kernels
(docs/batch-invariance.md), so that one run measures what invariance costs. The peers (transformers, llama.cpp's
server, vLLM) are compared from a checkout: `python -m benchmarks.compare`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rqbatcher.config import POLICIES, EngineConfig, Policy

REDIS_SUFFIX = "@redis"
NO_PREFIX_CACHING_SUFFIX = ":no-prefix-caching"
NO_BATCH_INVARIANT_SUFFIX = ":no-batch-invariant"
BATCHER_PREFIX = "batcher:"


@dataclass(frozen=True)
class System:
    policy: Policy
    through_redis: bool = False
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes computed before
    batch_invariant: bool = True  # as the shared settings say, or off

    @classmethod
    def parse(cls, name: str) -> System:
        """`batcher:continuous`, `batcher:static:no-prefix-caching@redis`...; ValueError names the choices."""
        base = name.removesuffix(REDIS_SUFFIX)
        through_redis = base != name
        invariant = not base.endswith(NO_BATCH_INVARIANT_SUFFIX)
        base = base.removesuffix(NO_BATCH_INVARIANT_SUFFIX)
        caching = not base.endswith(NO_PREFIX_CACHING_SUFFIX)
        policy = base.removesuffix(NO_PREFIX_CACHING_SUFFIX).removeprefix(BATCHER_PREFIX)
        if base.startswith(BATCHER_PREFIX) and policy in POLICIES:
            return cls(policy, through_redis, caching, invariant)
        raise ValueError(f"unknown {name}; the systems are {', '.join(BASE_SYSTEMS)}, each may end with "
                         f"{NO_PREFIX_CACHING_SUFFIX}, then {NO_BATCH_INVARIANT_SUFFIX}, then {REDIS_SUFFIX} (the "
                         "peers run from a checkout: python -m benchmarks.compare)")

    @property
    def name(self) -> str:
        caching = "" if self.prefix_caching else NO_PREFIX_CACHING_SUFFIX
        invariant = "" if self.batch_invariant else NO_BATCH_INVARIANT_SUFFIX
        return f"{BATCHER_PREFIX}{self.policy}{caching}{invariant}{REDIS_SUFFIX if self.through_redis else ''}"

    def via_redis(self) -> System:
        """The same system served through Redis and a worker."""
        return replace(self, through_redis=True)

    def without_prefix_caching(self) -> System:
        return replace(self, prefix_caching=False)

    def engine_config(self, shared: EngineConfig) -> EngineConfig:
        """The settings this system runs with: the shared ones, with its own policy and prefix caching (and batch
        invariance off if its name says so)."""
        return replace(shared, policy=self.policy, prefix_caching=self.prefix_caching,
                       batch_invariant=shared.batch_invariant and self.batch_invariant)

    def __str__(self) -> str:
        return self.name


BASE_SYSTEMS = tuple(f"{BATCHER_PREFIX}{p}" for p in POLICIES)
ALL_SYSTEMS = tuple(f"{BATCHER_PREFIX}{p}{c}{r}" for c in ("", NO_PREFIX_CACHING_SUFFIX) for r in ("", REDIS_SUFFIX)
                    for p in POLICIES)
