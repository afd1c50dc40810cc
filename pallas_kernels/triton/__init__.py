"""Kernels for NVIDIA GPUs through the Pallas Triton lowering (``pl.pallas_call`` +
``jax.experimental.pallas.triton``); one file per kernel."""
