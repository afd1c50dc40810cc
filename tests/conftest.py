"""Test-wide setup.

* The ``gpu`` marker runs only where JAX sees a GPU (reported as skipped elsewhere).
* After each test module, JAX's in-process caches of compiled programs are dropped, so memory
  stays bounded by one module's programs (a full run compiles a few thousand, interpret-mode
  kernels among them, some large). Two full single-process runs ended in a crash inside XLA's
  CPU compiler late in the run, in a test that passes alone (tests/test_vocab_top_k.py); the
  cause was not pinned down, and with the caches dropped and the files split over two workers
  (the README's ``-n 2 --dist loadfile``) it has not recurred.
* JAX's persistent compilation cache is on for the run, in a folder under the system's temporary
  directory shared by the run's pytest-xdist workers (``_run_cache_dir``): the same program,
  compiled again in a later module (after the caches are dropped) or in the other worker, is
  loaded instead (on 2 CPU cores a second run of tests/test_exactness.py and
  tests/test_near_zero_temperature.py took 72 s against 110 s). The folder is removed at the
  end of the run.
* On a GPU the tests that are not marked ``gpu`` run with full-precision float32 matmuls
  (``jax_default_matmul_precision="highest"``): they are written for the CPU, and their greedy
  equality checks compare a verify block with one-token steps, whose TF32 matmuls (a GPU's
  default) round differently (docs/performance.md, "Greedy agreement"). The ``gpu`` tests set
  the precision they need themselves.
* pytest-xdist (``--dist loadfile``) hands out whole files, the files with the most tests first
  (its ``--loadscope-reorder``, on by default).
* ``models``: the tiny random target and drafter (float32, ``tests/_model_fixtures.tiny_pair``),
  built once per test module; a file that needs other models defines its own ``models``.
* ``default_dir``: the small default model, trained once per run for every test that needs it
  (tests/test_cli.py, tests/test_tpu_kernels.py), whichever pytest-xdist worker asks first.
"""

import fcntl
import gc
import os
import shutil
import tempfile

import jax
import pytest

from ddtree_jax import compilation_cache
from ddtree_jax.training.recipe import make_default
from tests._model_fixtures import tiny_pair


def _run_cache_dir(config) -> str:
    """This run's compilation cache: one folder per run, named by the pid of the pytest process
    that runs the session (a pytest-xdist worker's parent)."""
    run = os.getppid() if hasattr(config, "workerinput") else os.getpid()
    return os.path.join(tempfile.gettempdir(), f"ddtree_jax_test_cache_{run}")


def pytest_configure(config):
    compilation_cache.enable(_run_cache_dir(config))


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without workers) cleans up
        shutil.rmtree(_run_cache_dir(config), ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (compiled Pallas kernels); run `python -m pytest -m gpu` on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test's set-up (its fixtures' included), call and teardown under full-precision matmuls off
    the CPU for the tests not marked ``gpu`` (module docstring); else the default precision."""
    if jax.default_backend() == "cpu" or "gpu" in item.keywords:
        return (yield)
    with jax.default_matmul_precision("highest"):
        return (yield)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_the_module():
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def models():
    """The tiny pair (``tiny_pair``: every kind of layer once), fresh per test module."""
    return tiny_pair(0)


@pytest.fixture(scope="session")
def default_dir(tmp_path_factory):
    """The CPU recipe's pair and tokenizer (``ddtree_jax.training.recipe``) with short training
    (the demo trains longer): enough that both losses fall (tests/test_cli.py checks) and that the
    drafter's trees get tokens accepted. ~1 min on 2 CPU cores, once per run: under pytest-xdist
    the workers share this run's base directory, and the first to lock it trains while the others
    wait, then load what it wrote (``make_default`` returns a finished folder as it is)."""
    kw = dict(vocab_size=300, target_steps=30, drafter_steps=30, drafter_prompt_lengths=(8,), log=lambda msg: None)
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make_default(str(tmp_path_factory.mktemp("default")), **kw)
    shared = tmp_path_factory.getbasetemp().parent  # this run's directory, common to its workers
    with open(shared / "default.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return make_default(str(shared / "default"), **kw)
