"""The serving benchmark runs end to end at its smoke size: a server process per variant, client
processes, the client's and the server's own figures per level (it drives the real server, so a
server or metrics change that breaks it shows here, not on the GPU)."""

from bench import bench_serving


def test_bench_serving_smoke(tmp_path):
    report = bench_serving.main(["--smoke", "--methods", "ddtree", "--concurrency", "1", "3",
                                 "--requests-per-level", "6", "--client-processes", "2", "--engine-process", "on",
                                 "--switch-interval", "2", "--out", str(tmp_path)])
    (name, levels), = report["results"].items()
    assert name == "ddtree+engine-process+si2ms"  # (the servers ran with serve --switch-interval 2)
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["requests"] == 6 and lv["output_tokens"] == 6 * report["max_tokens"]
        assert lv["client_processes"] == min(2, lv["concurrency"])
        assert 0 < lv["headers_ms_mean"] <= lv["ttft_ms_mean"]  # headers come before the first text
        assert lv["mean_tau"] >= 1
        inside = lv["inside"]
        # the server's metrics cover exactly the level's requests (the untimed pass before is excluded)
        assert 0 < inside["queue_ms"] + inside["slot_to_token_ms"] <= inside["ttft_ms"] * 1.001 + 1e-3
        assert inside["steps_per_s"] > 0 and sum(inside["dispatches"].values()) > 0
    text = open(next(tmp_path.glob("serving_*_smoke_*.md"))).read()
    assert "| ddtree+engine-process+si2ms | 3 | 6 |" in text and "client to headers ms" in text
