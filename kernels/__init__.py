"""Triton kernels, each beside the PyTorch reference that is the CPU path and the test oracle.

- paged_decode_attention: split-K flash-decoding over 16-token pages, GQA, int8 K/V, keys
  rotated in registers, exact per-token attention mass from stored scores.
- paged_prefill_attention: varlen chunks over cached pages + causal within the chunk, optional
  observation-window attention mass.
- kv_append / kv_compact: scatter new K/V (quantizing int8) and move retained tokens in place.
- rmsnorm (fused residual add) and rotary.
- ops.KernelOps: the dispatch point (Triton on CUDA, the reference elsewhere).
- check: `python -m streamgrok_kernels.check`, correctness at production shapes and timings on
  a GPU.
"""
