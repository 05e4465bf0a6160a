"""Development experiments: one-off measurements behind docs/benchmark-log.md, run from a checkout as
`python -m rqbatcher.workers.bench.experiments.<name>`. They are not part of the wheel, and nothing in the package
imports them."""
