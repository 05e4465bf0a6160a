"""Development benchmarks, run from a checkout as `python -m benchmarks.<name>`: the comparison with the peers
(transformers, llama.cpp's server, vLLM), the roofline, plots, and the one-off experiments behind
docs/benchmark-log.md. Not part of the wheel: these modules import the package, and the package never imports them."""
