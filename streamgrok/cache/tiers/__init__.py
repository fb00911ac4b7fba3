"""The KV cache's host and disk tiers and recall: where evicted K/V go, and which of them
come back into a pass (`recaller.Recaller`, given the cache's core)."""
