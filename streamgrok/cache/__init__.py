"""Paged streaming KV cache.

Design (see also DESIGN.md §2):

* Pages: one pool of fixed-size pages (16 tokens) shared by all layers; each sequence has one
  page table *per layer*, so per-layer budgets (PyramidKV) hold fewer pages in upper layers.
* Positions are cache-relative: keys are stored *before* rotary and rotated at attention time
  by their index in the layer's (compacted) cache; a query is rotated by the number of tokens
  cached before it. After eviction the retained tokens are simply renumbered 0..n-1, so a model
  trained on 8k positions keeps working after any number of streamed tokens, and repeated
  compaction never accumulates rotation error (which re-rotating stored keys would, in 8-bit).
* Every cached token carries modality, timestamp, source id (frame number), a group (one frame's
  tokens form one group when eviction is frame-aware), a protected flag, and an importance
  score accumulated from the attention computation itself.
* Eviction selects per layer which tokens to keep (protected + sinks + recent window + the best
  scored rest) and compacts the layer's pages in place; shared prefix pages are copied on write.
* Storing, attending and compacting go through `streamgrok_kernels.ops.KernelOps`: Triton kernels
  on CUDA that read the pages directly, the PyTorch references (gather + SDPA) elsewhere.
"""
