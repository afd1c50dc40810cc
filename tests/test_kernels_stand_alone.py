"""pallas_kernels imports nothing from ddtree_jax: each kernel module loads on its own."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("module", [f"pallas_kernels.{family}.{kernel}" for family in ("triton", "mosaic_tpu")
                                    for kernel in ("fused_sample", "tree_builder", "accept_walk", "vocab_top_k")])
def test_kernel_imports_only_jax(module):
    code = (f"import sys, {module}; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ddtree_jax', 'flax', 'chex', 'torch')); "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stdout + result.stderr
