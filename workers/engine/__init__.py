"""The request engine: `add`, `step`, `abort` over the scheduler and the model runner (engine.py), and what it
does per request: sampling, constrained decoding, logprobs, `n` choices, detokenization. api.py is its interface
for the job worker, which imports nothing else from here."""
