"""Model execution: loading, the dtype, the attention backend, and one forward per engine step (runner.py)."""
