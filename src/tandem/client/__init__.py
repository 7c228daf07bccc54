"""tandem's client API: what environments (and the orchestrator, `evaluate`, benchmarks) use to
talk to inference servers. It imports nothing of the orchestrator, so an environment depends on
this small package alone:

- `inference.InferenceClient`: chat and token-id completions of one server, with token ids,
  logprobs and weight versions (`Generation`, `ChatResult`); `ServerPool` spreads work over
  several servers;
- `config.SamplingConfig` (how a request samples, `for_part` for an environment's own seeded
  sub-requests) and `config.ClientConfig` (timeouts, retries, API key);
- `seeds`: request seeds as pure functions of where a request sits in a run.
"""
