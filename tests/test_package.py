"""The public API: every exported name resolves, importing the package (or its configs) does not
import JAX, the function ``ddtree_jax.generate`` stays the function after its module is imported."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_is_light_and_every_export_resolves():
    code = ("import sys, ddtree_jax as dt; assert 'jax' not in sys.modules, 'importing the package imported jax'; "
            "import ddtree_jax.generation, ddtree_jax.decode_round; "
            "assert callable(dt.generate) and dt.generate.__module__ == 'ddtree_jax.generation'; "
            "missing = [n for n in dt.__all__ if getattr(dt, n, None) is None]; assert not missing, missing; "
            "print('OK')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert "OK" in result.stdout, result.stderr[-2000:]


def test_configs_import_without_jax():
    """``ddtree_jax.config`` is what the command line validates its options with before anything
    heavy loads: importing it and building every config imports no JAX."""
    code = ("import sys; from ddtree_jax.config import DecodeConfig, EngineConfig, ExecutionConfig; "
            "EngineConfig(decode=DecodeConfig(method='ar', stop_token_ids=[2])); ExecutionConfig(impl='reference'); "
            "assert 'jax' not in sys.modules, 'importing ddtree_jax.config imported jax'; print('OK')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert "OK" in result.stdout, result.stderr[-2000:]


def test_preflight_knows_the_registered_architectures():
    """The command line checks architectures without importing JAX; its lists must match the registry."""
    from ddtree_jax import _preflight
    from ddtree_jax.models import DRAFTERS, TARGETS

    assert set(_preflight.TARGET_ARCHITECTURES) == set(TARGETS)
    assert set(_preflight.DRAFTER_ARCHITECTURES) == set(DRAFTERS)
