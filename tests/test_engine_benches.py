"""The engine's benchmarks run end to end at their smoke sizes (they reach into the engine's
internals, so an engine change that breaks them shows here, not on the GPU)."""

import glob

import jax
import jax.numpy as jnp

from bench import bench_engine, bench_engine_host


def test_bench_engine_host_smoke(tmp_path):
    bench_engine_host.main(["--smoke", "--out", str(tmp_path)])
    assert glob.glob(str(tmp_path / "engine_host_*.md"))


def test_bench_engine_smoke_with_repeats_and_admission_groups():
    report = bench_engine.main(["--smoke", "--batches", "2", "--methods", "ar", "--repeats", "2",
                                "--admit-group", "1", "2", "--sync-every", "1"])
    rows = report["rows"]
    assert [r["admit_group"] for r in rows] == [1, 2]
    for r in rows:
        assert r["greedy_equal"] == f"{r['requests']}/{r['requests']}"  # float32 on the CPU: generate()'s tokens
        lo, hi = r["ratio_range"]
        assert 0 < lo <= r["engine_over_generate"] <= hi


def test_bench_round_kernels_smoke(tmp_path):
    from bench import bench_round_kernels

    report = bench_round_kernels.main(["--smoke", "--plans", "ddtree:4", "ar:0:ctx", "ar:0:held", "auto:4:fixed",
                                       "--auto-max", "4", "--out", str(tmp_path)])
    rows = report.sections["rounds"]
    # the autoregressive reference comes first
    assert [r["plan"] for r in rows] == ["ar", "ddtree@4", "ar extending the drafter's context",
                                         "ar holding the drafter's context back",
                                         "auto@4 (a loop of known trip count) (8 rounds a call)"]
    assert rows[0]["wall_x_ar"] == 1 and all(r["wall_us"] > 0 for r in rows)
    assert glob.glob(str(tmp_path / "round_kernels_*.md"))


def test_bench_engine_smoke_launched_inline_with_a_timeline_from_closed_loop_clients():
    report = bench_engine.main(["--smoke", "--batches", "2", "--methods", "ar", "--launcher", "inline",
                                "--timeline", "--streams", "3"])
    (row,) = report["rows"]
    assert row["launcher"] == "inline" and row["greedy_equal"] == f"{row['requests']}/{row['requests']}"
    assert row["streams"] == 3
    assert row["sync_every"] == "auto" and row["dispatches"]  # the engine's default: sizes chosen per dispatch
    spans = row["timeline_ms"]
    assert all(spans[k] > 0 for k in ("step", "launch", "read", "launch_end_to_read_end"))
    assert spans["launch_end_after_step_start"] >= spans["launch"]


def test_bench_launch_smoke(tmp_path):
    import json

    from bench import bench_launch

    bench_launch.main(["--smoke", "--methods", "ar", "--out", str(tmp_path)])
    (path,) = glob.glob(str(tmp_path / "launch_*.json"))
    with open(path) as f:
        (row,) = json.load(f)["launch"]
    assert row["same_tokens_as_first"] == "yes" and row["batch"] == 4
    assert all(row[k] > 0 for k in ("call_us", "call_copy_us", "launch_us", "launch_busy_us", "pipelined_us",
                                    "noop_all_us", "noop_1_us", "synthetic_fresh_us", "synthetic_same_us",
                                    "synthetic_alternate_us"))


def test_bench_prefix_ttft_smoke(tmp_path):
    """The paged engine's second request finds the first's prefix: its 256 tokens, 16 full pages
    (the tails differ from the first token on)."""
    from bench import bench_prefix_ttft

    report = bench_prefix_ttft.main(["--smoke", "--layouts", "paged", "--methods", "ar", "--trials", "1",
                                      "--out", str(tmp_path)])
    (row,) = report.sections["ttft"]
    assert row["engine"] == "paged ar" and row["prefix"] == 256 and row["cached_per_hit"] == 256
    assert row["miss_ms"] > 0 and row["hit_ms"] > 0
    assert glob.glob(str(tmp_path / "prefix_ttft_*.md"))


def test_replay_auto_budget_prices_the_rounds_by_the_table(tmp_path):
    import json

    import pytest

    from bench import replay_auto_budget

    runs = {"runs": [{"label": "ar"}, {"label": "auto", "costs_ms": {"2": [1.0, 2.0, 3.0, 4.0], "64": [1.0]}}]}
    src = tmp_path / "auto_budget.json"
    src.write_text(json.dumps(runs))
    budgets = (0, 4, 8, 16)
    assert replay_auto_budget.cost_tables(str(src), ["1:0.5,1,1,2"], budgets) == {2: (1.0, 2.0, 3.0, 4.0),
                                                                                 1: (0.5, 1.0, 1.0, 2.0)}
    with pytest.raises(SystemExit, match="budget set"):
        replay_auto_budget.cost_tables(None, ["1:0.5,1"], budgets)
    out = replay_auto_budget.main(["--smoke", "--costs-from", str(src), "--batches", "2", "--settings", "T=0",
                                   "--budgets", "--out", str(tmp_path)])
    (run,) = out["runs"]
    rounds = [run["histogram"][str(b)] for b in budgets]
    assert run["auto_ms"] == sum(n * c for n, c in zip(rounds, (1.0, 2.0, 3.0, 4.0), strict=True)) > 0
    assert run["ar_ms"] == out["new"] - 1 and run["over_ar"] == run["ar_ms"] / run["auto_ms"]
    assert (tmp_path / "auto_replay_cpu-smoke_{}.md".format(out["date"].replace("-", ""))).exists()


def test_replay_auto_budget_on_the_k2_slice_runs_each_acceptance_level(tmp_path):
    """``--k2-slice``: the controlled-acceptance pair at the tiny shapes, once per level, each run
    named by its level; the levels set the acceptance (greedy: the high level's drafts are
    accepted, the low level's hardly); ``--restart-ms`` prices each probe run alone."""
    import pytest

    from bench import replay_auto_budget

    out = replay_auto_budget.main(["--k2-slice", "1", "--acceptance", "high", "low", "--auto-max", "4",
                                   "--costs", "1:1,3", "--restart-ms", "0.5", "--batches", "1", "--b1-prompts", "1",
                                   "--settings", "T=0", "--budgets", "4", "--prompt-len", "8", "--new", "12",
                                   "--out", str(tmp_path)])
    high, low = out["runs"]
    assert (high["acceptance"], low["acceptance"]) == ("high", "low")
    # the prior does not pay (3 > FIRST_DRAFT_TOKENS x 1) and a restart (0.5 ms) is cheap: the first probe ran
    # alone, priced
    for run in (high, low):
        rounds = [run["histogram"][str(b)] for b in out["budgets"]]
        assert run["restarts"] == 1 and run["auto_ms"] == pytest.approx(
            sum(n * c for n, c in zip(rounds, (1.0, 3.0), strict=True)) + 0.5)
    assert high["fixed_over_ar"]["4"] > 2.0 * low["fixed_over_ar"]["4"]
    assert "| high | 1 | T=0 |" in (tmp_path / "auto_replay_cpu_{}.md".format(out["date"].replace("-", ""))).read_text()


def test_batch_one_benches_pool_prompts_decoded_one_after_the_other(tmp_path):
    """bench_auto_budget's batch 1 decodes several prompts, each on its own: one output with the
    requests in order and rounds, seconds and auto's histogram, tokens and dispatches summed; the
    replay prices autoregressive decoding for all of them."""
    import numpy as np

    from bench import bench_auto_budget, replay_auto_budget
    from bench.bench_e2e import smoke_pair
    from ddtree_jax.config import DecodeConfig

    target, drafter, _ = smoke_pair()
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    kw = dict(max_new_tokens=5, config=DecodeConfig(budget="auto", auto_max_budget=4, auto_costs=(1.0, 1.5)))
    alone = [bench_auto_budget.decode((target, drafter), [p], False, **kw) for p in prompts]
    pooled = bench_auto_budget.decode((target, drafter), prompts, True, **kw)
    assert pooled.tokens == [t for o in alone for t in o.tokens]
    assert pooled.rounds == sum(o.rounds for o in alone) and pooled.batch_sizes == [1]
    assert pooled.auto.rounds == tuple(np.sum([o.auto.rounds for o in alone], axis=0))
    assert pooled.auto.sequence == alone[0].auto.sequence + alone[1].auto.sequence
    # every label's record keeps its dispatches (the fixed budgets' timelines are auto's baseline)
    plain = bench_auto_budget.decode((target, drafter), prompts, True, max_new_tokens=5,
                                     config=DecodeConfig(method="ar"))
    recs = {r["label"]: r for r in bench_auto_budget._records({"auto": [pooled], "ar": [plain]})}
    for label, out in (("auto", pooled), ("ar", plain)):
        assert [row[:3] for row in recs[label]["dispatches"]] == [[d.budget, d.rounds, d.form] for d in out.dispatches]
    assert "histogram" in recs["auto"] and "histogram" not in recs["ar"]
    out = replay_auto_budget.main(["--smoke", "--auto-max", "4", "--costs", "1:1,1.5", "--batches", "1",
                                   "--b1-prompts", "2", "--settings", "T=0", "--budgets", "--new", "6",
                                   "--out", str(tmp_path)])
    (run,) = out["runs"]
    assert run["batch"] == 1 and run["ar_ms"] == 2 * (out["new"] - 1)


def test_bench_auto_budget_resumed_with_other_batches_reports_every_batch(tmp_path):
    """A results file resumed by a call for other batches reports the cells of both calls in its
    main table, and names both commands."""
    import json

    from bench import bench_auto_budget

    runs = [dict(label=label, batch=64, setting="T=0", acceptance=None, tokens_per_s=tps, rounds=0)
            for label, tps in (("ar", 100.0), ("ddtree@2", 90.0), ("ddtree@4", 80.0))]
    (tmp_path / "x.json").write_text(json.dumps(dict(batches=[64], command="python first --batches 64", runs=runs)))
    out = bench_auto_budget.main(["--smoke", "--resume", "--minutes", "0", "--tag", "x", "--out", str(tmp_path)])
    assert out["batches"] == [1, 4, 64] and out["runs"] == runs
    md = (tmp_path / "x.md").read_text()
    assert "| - | 64 | T=0 | 100.0 | 0.90 | 0.80 |" in md, md
    assert "python first --batches 64`, then `python" in md


def test_bench_auto_budget_resume_runs_a_cell_cut_short_again_whole(tmp_path, monkeypatch):
    """--resume skips a cell whose every label has its --repeats runs, and runs a cell cut short
    (a label missing, or with fewer runs) again with every label, replacing its records."""
    import json

    from bench import bench_auto_budget

    labels = ["ar", "ddtree@2", "ddtree@4", "auto"]
    def rec(label, setting, runs):
        r = dict(label=label, batch=4, setting=setting, acceptance=None, tokens_per_s=100.0,
                 tokens_per_s_runs=[100.0] * runs, rounds=0, tau=1.0)
        return r | (dict(histogram={"0": 1}, expected=1.0, realized=1.0) if label == "auto" else {})

    full = [rec(label, "T=0", 2) for label in labels]
    cut = [rec("ar", "T=1", 1), rec("ddtree@2", "T=1", 2)]
    (tmp_path / "x.json").write_text(json.dumps(dict(batches=[4], command="python first", runs=full + cut)))
    cells = []

    def run_cell(target, drafter, prompts, todo, setting, new, auto_max, seed, repeats, deadline, publish, **kw):
        cells.append((len(prompts), setting, list(todo)))
        publish([rec(label, setting, repeats) | {"tokens_per_s": 50.0} for label in todo])

    monkeypatch.setattr(bench_auto_budget, "run_cell", run_cell)
    out = bench_auto_budget.main(["--smoke", "--resume", "--batches", "4", "--settings", "T=0", "T=1",
                                  "--repeats", "2", "--tag", "x", "--out", str(tmp_path)])
    # (--smoke runs batches 1, with 2 prompts, and 4) batch 4: T=0 complete, skipped; T=1 cut
    # short, every label again
    assert cells == [(2, "T=0", labels), (2, "T=1", labels), (4, "T=1", labels)]
    by_setting = {s: [r for r in out["runs"] if r["setting"] == s and r["batch"] == 4] for s in ("T=0", "T=1")}
    assert by_setting["T=0"] == full
    assert [r["label"] for r in by_setting["T=1"]] == labels and all(r["tokens_per_s"] == 50.0
                                                                      for r in by_setting["T=1"])


def test_bench_auto_budget_starts_no_cell_the_longest_so_far_would_not_finish(tmp_path, monkeypatch):
    """--minutes: a cell starts only if the longest cell so far would end by the deadline (cells
    of 100 s against 4 minutes: two run, the third would end at 300 s and does not start)."""
    import types

    from bench import bench_auto_budget

    clock = [0.0]
    monkeypatch.setattr(bench_auto_budget, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cells = []

    def run_cell(target, drafter, prompts, todo, setting, new, auto_max, seed, repeats, deadline, publish, **kw):
        cells.append(setting)
        clock[0] += 100.0
        publish([dict(label=label, tokens_per_s=1.0, tokens_per_s_runs=[1.0] * repeats, rounds=0, tau=1.0)
                 | (dict(histogram={"0": 1}, expected=1.0, realized=1.0) if label == "auto" else {})
                 for label in todo])

    monkeypatch.setattr(bench_auto_budget, "run_cell", run_cell)
    out = bench_auto_budget.main(["--smoke", "--settings", "T=0", "T=1", "--minutes", "4", "--out", str(tmp_path)])
    assert cells == ["T=0", "T=1"], cells  # (--smoke: batch 1's two settings; batch 4's first would end late)
    assert {r["batch"] for r in out["runs"]} == {1}


def test_bench_e2e_runs_again_a_timed_call_that_compiled(monkeypatch):
    """bench_e2e.measure does not keep a call that compiled a program as a timing: the group runs
    again, and the call that compiled nothing is the one counted."""
    import types

    from bench import bench_e2e

    made = []

    def run(target, drafter, prompts, *args, **kw):
        n = len(made)
        if n == 0:  # the first call compiles a program no call compiled before
            jax.jit(lambda x: x * 5 + 2)(jnp.float32(n)).block_until_ready()
        made.append(n)
        return types.SimpleNamespace(seconds=1.0 + n, new_tokens=10, requests=[], tokens=[[n]])

    monkeypatch.setattr(bench_e2e, "_run", run)
    rec, tokens = bench_e2e.measure(None, None, [[1], [2]], "ar", 0, None, 4, 8, 0)
    assert made == [0, 1, 2] and tokens == [[1], [2]]  # group 1: call 0 compiled, call 1 kept
    assert rec["seconds"] == 2.0 + 3.0 and rec["new_tokens"] == 20


def test_bench_auto_budget_runs_again_a_timed_call_that_compiled(monkeypatch):
    """A timed call that compiles a program (a budget the warm-up never chose) is not kept: the
    bench runs it again, and keeps a call that compiled nothing."""
    import types

    from bench import bench_auto_budget

    made = []

    def decode(models, prompts, alone, **kw):
        n = len(made)
        if n == 1:  # the first timed call compiles a program no call compiled before
            jax.jit(lambda x: x * 3 + 1)(jnp.float32(n)).block_until_ready()
        made.append(types.SimpleNamespace(auto=None, call=n))
        return made[-1]

    kept = []
    monkeypatch.setattr(bench_auto_budget, "decode", decode)
    monkeypatch.setattr(bench_auto_budget, "_records", lambda outs: {k: [o.call for o in v] for k, v in outs.items()})
    bench_auto_budget.run_cell(None, None, [], ["ar"], "T=0", 4, 4, 0, 2, float("inf"), kept.append)
    assert kept[-1] == {"ar": [2, 3]}, kept  # call 0: the warm-up; call 1 compiled: timed again


def test_bench_auto_budget_auto_plain_prices_every_drafted_budget_out(tmp_path, monkeypatch):
    """--auto-plain adds the label ``auto-plain``: auto with given costs under which no drafted
    budget can pay (its plain rounds, held-back context and probes), reported beside auto in the
    main table."""
    import json

    from bench import bench_auto_budget
    from ddtree_jax.config import auto_budget_set

    config = bench_auto_budget._config("auto-plain", 8, 0)
    assert config.is_auto and config.auto_costs[0] == 1.0
    assert len(config.auto_costs) == len(auto_budget_set(8))
    assert min(config.auto_costs[1:]) >= bench_auto_budget.PRICED_OUT > 64  # (more than a tree's tokens)
    assert bench_auto_budget._config("auto", 8, 0).auto_costs is None
    seen = []

    def run_cell(target, drafter, prompts, todo, setting, new, auto_max, seed, repeats, deadline, publish, **kw):
        seen.append(list(todo))
        tps = dict(ar=100.0, auto=110.0, **{"auto-plain": 97.0})
        publish([dict(label=label, batch=len(prompts), setting=setting, acceptance=None, rounds=0,
                      tokens_per_s=tps.get(label, 90.0), tokens_per_s_runs=[tps.get(label, 90.0)], tau=1.0)
                 | (dict(histogram={"0": 1}, expected=1.0, realized=1.0) if label.startswith("auto") else {})
                 for label in todo])

    monkeypatch.setattr(bench_auto_budget, "run_cell", run_cell)
    out = bench_auto_budget.main(["--smoke", "--auto-plain", "--settings", "T=0", "--repeats", "1",
                                  "--tag", "x", "--out", str(tmp_path)])
    assert seen and all(todo[-2:] == ["auto", "auto-plain"] for todo in seen)
    assert json.loads((tmp_path / "x.json").read_text())["runs"] == out["runs"]
    md = (tmp_path / "x.md").read_text()
    assert "| expected / realized tokens | auto, plain only |" in md
    assert "| 1.10 | 1.22 | 0: 1 | 1 / 1 | 0.97 |" in md, md
