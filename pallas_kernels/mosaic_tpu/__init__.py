"""Kernels for TPUs through Pallas' Mosaic TPU lowering (``pl.pallas_call`` +
``jax.experimental.pallas.tpu``); one file per kernel. Off a TPU they run in Pallas' TPU interpret
mode (``interpret=pltpu.InterpretParams()``), which is how the CPU tests check them; they have not
run on a TPU (docs/kernels.md, "TPU kernels")."""
