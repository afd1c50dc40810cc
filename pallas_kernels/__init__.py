"""Pallas kernels for the hot loops of tree speculative decoding, organised by backend.

Each kernel takes and returns plain arrays and imports only JAX; its plain-JAX reference, the
dispatch and the result types live in ``ddtree_jax`` (see ``ddtree_jax.backend``).

* ``pallas_kernels.triton``: NVIDIA GPUs through Pallas' Triton lowering (``interpret=True`` runs
  them on a CPU for tests): ``fused_sample`` (filters + one exact draw per row), ``tree_builder``
  (the DDTree pop loop), ``accept_walk`` (the accept walk).
* ``pallas_kernels.mosaic_tpu``: TPUs through Pallas' Mosaic TPU lowering, the same three kernels
  with the same contracts (``interpret=True`` runs them in TPU interpret mode on a CPU; they have
  not run on a TPU).
"""
