"""Kernels for NVIDIA Hopper GPUs through Pallas Mosaic GPU (``plgpu.kernel``: TMA, ``wgmma``,
warp-specialised warpgroups); one file per kernel."""
