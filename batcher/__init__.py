"""batcher: LLM generation jobs on Redis, served with continuous batching.

This package is the light core (schema, client, scheduler, CLI). It never imports torch,
so that a backend can enqueue jobs with `pip install rqbatcher`.
"""

__version__ = "0.1.0"
