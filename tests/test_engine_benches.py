"""The engine's benchmarks run end to end at their smoke sizes (they reach into the engine's
internals, so an engine change that breaks them shows here, not on the GPU)."""

import glob

from bench import bench_engine, bench_engine_host


def test_bench_engine_host_smoke(tmp_path):
    bench_engine_host.main(["--smoke", "--out", str(tmp_path)])
    assert glob.glob(str(tmp_path / "engine_host_*.md"))


def test_bench_engine_smoke_with_repeats_and_admission_groups():
    report = bench_engine.main(["--smoke", "--batches", "2", "--methods", "ar", "--repeats", "2",
                                "--admit-group", "1", "2"])
    rows = report["rows"]
    assert [r["admit_group"] for r in rows] == [1, 2]
    for r in rows:
        assert r["greedy_equal"] == f"{r['requests']}/{r['requests']}"  # float32 on the CPU: generate()'s tokens
        lo, hi = r["ratio_range"]
        assert 0 < lo <= r["engine_over_generate"] <= hi


def test_bench_round_kernels_smoke(tmp_path):
    from bench import bench_round_kernels

    report = bench_round_kernels.main(["--smoke", "--plans", "ddtree:4", "ar:0:ctx", "--out", str(tmp_path)])
    rows = report.sections["rounds"]
    # the autoregressive reference comes first
    assert [r["plan"] for r in rows] == ["ar", "ddtree@4", "ar extending the drafter's context"]
    assert rows[0]["wall_x_ar"] == 1 and all(r["wall_us"] > 0 for r in rows)
    assert glob.glob(str(tmp_path / "round_kernels_*.md"))
