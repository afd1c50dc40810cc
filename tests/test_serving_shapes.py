"""serving.shapes.ShapeCache: a prefill shape not compiled yet runs on the smallest compiled cover
while the exact one compiles in the background (through the engine: tests/test_serving_engine.py,
``test_prefill_on_a_cover_gives_generates_tokens``)."""

import threading

from ddtree_jax.serving.shapes import ShapeCache


class FakeCompiler:
    """Records compiled shapes; a background compile waits for ``release``."""

    def __init__(self):
        self.calls: list[tuple[int, int, str]] = []
        self.release = threading.Event()
        self.started = threading.Event()  # a background compilation has begun

    def __call__(self, rows, tokens):
        name = threading.current_thread().name
        if name == "ddtree-compile":
            self.started.set()
            assert self.release.wait(10)
        self.calls.append((rows, tokens, name))
        return lambda: (rows, tokens)


def test_a_missing_shape_runs_on_the_smallest_cover_and_compiles_in_the_background():
    fake = FakeCompiler()
    cache = ShapeCache(fake)
    R, T, fn = cache.get(2, 16)  # nothing compiled: compiled now, in the caller
    assert (R, T, fn()) == (2, 16, (2, 16)) and fake.calls == [(2, 16, threading.current_thread().name)]
    cache.warm(8, 64)
    cache.warm(4, 128)
    cache.warm(2, 16)  # already compiled: nothing happens
    assert len(fake.calls) == 3
    R, T, fn = cache.get(4, 32)  # covers: (8, 64) with 512 cells, (4, 128) with 512: the smaller key wins the tie
    assert (R, T, fn()) == (4, 128, (4, 128))
    assert cache.get(4, 32)[:2] == (4, 128) and (4, 32) not in cache.shapes  # still compiling, queued once
    fake.release.set()
    assert cache.wait(10)
    assert cache.get(4, 32)[:2] == (4, 32) and (4, 32) in cache.shapes
    assert [c for c in fake.calls if c[2] == "ddtree-compile"] == [(4, 32, "ddtree-compile")]
    assert cache.get(16, 16)[:2] == (16, 16)  # no cover: compiled in the caller
    assert fake.calls[-1][2] != "ddtree-compile"


def test_without_background_every_new_shape_compiles_in_the_caller():
    fake = FakeCompiler()
    cache = ShapeCache(fake, background=False)
    cache.warm(8, 64)
    assert cache.get(2, 16)[:2] == (2, 16)
    assert all(c[2] != "ddtree-compile" for c in fake.calls) and len(fake.calls) == 2


def test_a_failed_background_compile_keeps_serving_on_the_cover():
    def compile_shape(rows, tokens):
        if threading.current_thread().name == "ddtree-compile":
            raise RuntimeError("out of memory")
        return lambda: (rows, tokens)

    cache = ShapeCache(compile_shape)
    cache.warm(4, 32)
    assert cache.get(2, 16)[:2] == (4, 32)
    assert cache.wait(10) and cache.get(2, 16)[:2] == (4, 32)  # retried, failed again, still the cover
    assert cache.wait(10)


def test_close_waits_for_the_running_compilation_and_starts_no_other():
    fake = FakeCompiler()
    cache = ShapeCache(fake)
    cache.warm(8, 64)
    cache.get(2, 16)
    cache.get(4, 16)  # queued behind (2, 16)
    assert fake.started.wait(10)
    threading.Timer(0.2, fake.release.set).start()
    cache.close(timeout=10)  # returns once (2, 16) is compiled
    assert [c[:2] for c in fake.calls if c[2] == "ddtree-compile"] == [(2, 16)]
    assert cache.get(4, 16)[:2] == (4, 16) and fake.calls[-1][2] != "ddtree-compile"  # now in the caller
