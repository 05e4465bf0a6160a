"""Commands that drive the engine directly, without Redis: `run` (offline batch) and `bench`."""

from __future__ import annotations

import click

from batcher.cli import main
from batcher.cli.options import engine_options
