"""The systems `batcher bench` compares, named as on its command line (no torch here: the CLI checks names).

`batcher:continuous` and `batcher:static` are this engine, driven step by step; with the suffix `@redis`
they are served through Redis and a worker instead. `hf-cb`, `hf-static` and `hf-naive` are the
transformers baselines (`workers.bench.peers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from batcher.config import POLICIES, Policy

REDIS_SUFFIX = "@redis"
BATCHER_PREFIX = "batcher:"
PEERS = ("hf-cb", "hf-static", "hf-naive")

Kind = Literal["batcher", "hf-cb", "hf-static", "hf-naive"]


@dataclass(frozen=True)
class System:
    kind: Kind
    policy: Policy | None = None  # batcher only
    through_redis: bool = False  # batcher only

    @classmethod
    def parse(cls, name: str) -> System:
        """`batcher:continuous`, `batcher:static@redis`, `hf-cb`...; ValueError names the choices."""
        if name in PEERS:
            return cls(name)
        through_redis = name.endswith(REDIS_SUFFIX)
        policy = name.removesuffix(REDIS_SUFFIX).removeprefix(BATCHER_PREFIX)
        if name.startswith(BATCHER_PREFIX) and policy in POLICIES:
            return cls("batcher", policy, through_redis)
        raise ValueError(f"unknown {name}; the systems are {', '.join(ALL_SYSTEMS)}")

    @property
    def name(self) -> str:
        if self.kind != "batcher":
            return self.kind
        return f"{BATCHER_PREFIX}{self.policy}{REDIS_SUFFIX if self.through_redis else ''}"

    def via_redis(self) -> System:
        """The same system served through Redis and a worker (peers have no such path: unchanged)."""
        return System(self.kind, self.policy, True) if self.kind == "batcher" else self

    def __str__(self) -> str:
        return self.name


ALL_SYSTEMS = tuple([f"{BATCHER_PREFIX}{p}" for p in POLICIES] + [f"{BATCHER_PREFIX}{p}{REDIS_SUFFIX}" for p in POLICIES]
                    + list(PEERS))
