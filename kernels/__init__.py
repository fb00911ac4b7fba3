"""Triton kernels, each beside the PyTorch reference that is the CPU path and the test oracle.

So far: paged_decode_attention (split-K, in-register key rotation, exact attention mass by a
K-only second pass). Not yet wired into the cache's dispatch; see issue #4.
"""
