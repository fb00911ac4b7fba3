"""Research harnesses, run from a source checkout and not shipped in the wheel: decode
throughput against llama.cpp's own benches, the KV cache's policies, recall and ranks, the
media stages, speech decoding options and grounding. `python -m benchmarks --help` lists
them; the load generators users run against a server stay in `streamgrok bench`."""
