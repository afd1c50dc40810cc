"""serving.dispatch.DispatchSizer: the rounds per dispatch chosen from measured wall time per round,
on hand-made costs (the engine running dispatches of changing sizes: tests/test_serving_engine.py)."""

import pytest

import ddtree_jax as dt
from ddtree_jax.serving.dispatch import DispatchSizer


def feed(sizer, running, cost_per_round, steps):
    """``steps`` dispatches at ``running`` slots, each observed at ``cost_per_round[k]``; returns the choices."""
    chosen = []
    for _ in range(steps):
        k = sizer.choose(running)
        chosen.append(k)
        sizer.observe(running, k, cost_per_round[k])
    return chosen


def test_measures_every_size_then_takes_the_smallest_within_tolerance():
    sizer = DispatchSizer((1, 2, 4), tolerance=0.1, min_obs=3)
    launch_bound = {1: 1.4e-3, 2: 0.75e-3, 4: 0.58e-3}  # the shipped pair's autoregressive rounds at 64 slots
    chosen = feed(sizer, 64, launch_bound, 20)
    assert chosen[:9] == [1, 1, 1, 2, 2, 2, 4, 4, 4]  # each size measured min_obs times, smallest first
    assert set(chosen[9:]) == {4}
    # Device-bound at one stream: a larger size is not 10% faster, so the smallest wins (latency).
    device_bound = {1: 1.00e-3, 2: 0.95e-3, 4: 0.93e-3}
    assert set(feed(sizer, 1, device_bound, 20)[9:]) == {1}
    # Within tolerance of the best but not the best: still the smaller.
    assert sizer.best(1) == 1 and sizer.costs(1) == pytest.approx(device_bound)
    # Loads are kept apart: 64 slots still chooses 4; 33 slots is in the same bucket as 64.
    assert sizer.choose(64) == 4 and sizer.choose(33) == 4


def test_one_outlier_does_not_move_the_choice_and_a_lasting_change_does():
    sizer = DispatchSizer((1, 2, 4), tolerance=0.1, min_obs=3, window=5, reprobe=10, reprobe_obs=2)
    costs = {1: 2.0, 2: 1.0, 4: 0.8}
    chosen = feed(sizer, 8, costs, 40)
    assert chosen[9:].count(4) >= 24 and 2 in chosen[9:]  # 4; its neighbour 2 re-measured twice every 10
    sizer.observe(8, 4, 5.0)  # a step held up by something else
    assert sizer.best(8) == 4
    chosen = feed(sizer, 8, {1: 1.0, 2: 1.0, 4: 1.0}, 300)  # the device became the bottleneck
    assert chosen[-20:].count(1) >= 16 and sizer.best(8) == 1


def test_a_size_whose_observations_rarely_come_is_measured_with_bounded_patience():
    # Under traffic most dispatches prefill, admit or release beside their rounds and are not
    # observations: here one dispatch in five is. Measuring size 1 must not run it for 15 dispatches.
    sizer = DispatchSizer((1, 2, 4), tolerance=0.1, min_obs=3, patience=3, reprobe=1000)
    costs = {1: 1.4e-3, 2: 0.75e-3, 4: 0.58e-3}
    chosen = []
    for i in range(60):
        k = sizer.choose(64)
        chosen.append(k)
        if i % 5 == 4:
            sizer.observe(64, k, costs[k])
    assert chosen[:9] == [1] * 9 and chosen[9:18] == [2] * 9  # patience: 3 tries per missing observation
    assert set(chosen[27:]) == {4} and sizer.best(64) == 4
    # A size never observed is never chosen once its tries are spent.
    sizer = DispatchSizer((1, 2, 4), min_obs=3, patience=2, reprobe=1000)
    chosen = [sizer.choose(8) for _ in range(6)]  # size 1, nothing observed
    assert chosen == [1] * 6
    for _ in range(3):
        sizer.observe(8, sizer.choose(8), 1.0)  # size 2
    for _ in range(3):
        sizer.observe(8, sizer.choose(8), 0.5)  # size 4
    assert {sizer.choose(8) for _ in range(10)} == {4} and 1 not in sizer.costs(8)


@pytest.mark.parametrize("kw", [dict(rounds=()), dict(rounds=(2, 1)), dict(rounds=(0, 1)), dict(tolerance=-1),
                                dict(min_obs=0), dict(min_obs=6, window=5), dict(reprobe=0), dict(reprobe_obs=0),
                                dict(reprobe_obs=4, min_obs=3), dict(patience=0)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match="DispatchSizer"):
        DispatchSizer(**kw)


def test_auto_rounds_per_dispatch_in_the_config():
    assert dt.DecodeConfig(sync_every="auto").sync_every == "auto"
    with pytest.raises(ValueError, match="sync_every: must be None, 'auto' or an integer >= 1"):
        dt.DecodeConfig(sync_every="fast")
    with pytest.raises(ValueError, match="sync_every: 'auto'.*budget='auto'"):
        dt.DecodeConfig(budget="auto", sync_every="auto")

