"""Pallas kernels for the hot loops of tree speculative decoding, organised by backend.

Each kernel takes and returns plain arrays and imports only JAX; its plain-JAX reference, the
dispatch and the result types live in ``ddtree_jax`` (see ``ddtree_jax.backend``).

* ``pallas_kernels.triton``: NVIDIA GPUs through Pallas' Triton lowering (``interpret=True`` runs
  them on a CPU for tests): ``fused_sample`` (filters + one exact draw per row), ``tree_builder``
  (the DDTree pop loop), ``accept_walk`` (the accept walk), ``vocab_top_k`` (the tree's per-depth
  top-k of the draft log-probabilities), ``moe_grouped_matmul`` (a MoE layer's
  routed experts over token copies sorted by expert), ``mla_attention`` (the target's MLA
  attention over the latent cache: decode, tree verify, prefill).
* ``pallas_kernels.mosaic_tpu``: TPUs through Pallas' Mosaic TPU lowering, the sampler, the tree
  builder, the accept walk and the vocabulary top-k with the same contracts (``interpret=True``
  runs them in TPU interpret mode on a CPU; they have not run on a TPU). The target's MoE and
  attention kernels exist for Triton only; on a TPU those run their plain-JAX paths.
"""
