"""Pallas kernels for the hot loops of tree speculative decoding, one kernel per file, by backend.

Each kernel takes and returns plain arrays and imports only JAX; its plain-JAX reference, the
dispatch and the result types live in ``ddtree_jax`` (``ddtree_jax.backend``). ``interpret=True``
runs a kernel on a CPU (how the tests run them).

* ``pallas_kernels.triton`` (NVIDIA GPUs, Pallas Triton lowering): ``fused_sample``,
  ``tree_builder``, ``accept_walk``, ``vocab_top_k``, ``moe_grouped_matmul``, ``mla_attention``,
  ``dense_matmul``, ``block_attention`` (the drafter's).
* ``pallas_kernels.mosaic_gpu`` (Hopper, Pallas Mosaic GPU): ``mla_prefix``, the MLA fast path.
* ``pallas_kernels.mosaic_tpu`` (TPUs, Pallas Mosaic TPU): ``fused_sample``, ``tree_builder``,
  ``accept_walk`` and ``vocab_top_k`` with the Triton versions' contracts; on a TPU the MoE and
  attention run their plain-JAX paths.
Design notes and measurements: docs/kernels.md.
"""
