"""Media ingest: decode, sample and de-duplicate frames, encode them, observe, interleave."""
