"""OpenAI's wire formats that more than the gateway speaks: batch lines, logprob objects, service tiers."""
