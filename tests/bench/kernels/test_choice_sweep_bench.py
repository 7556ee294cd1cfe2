"""bench/kernels/choice_sweep.py without a GPU: the generated layers and the summary of a sweep."""

from __future__ import annotations

from bench.kernels import choice_sweep as cs


def test_layers_are_deterministic_bounded_and_split_in_halves() -> None:
    rows = cs.layers(200, seed=3, max_gflop=10.0)
    assert rows == cs.layers(200, seed=3, max_gflop=10.0)
    assert rows != cs.layers(200, seed=4, max_gflop=10.0)
    assert [r["index"] for r in rows] == list(range(200))
    assert {r["half"] for r in rows[::2]} == {"fit"}
    assert {r["half"] for r in rows[1::2]} == {"held-out"}
    for r in rows:
        n, c_in, h, w = r["input"]
        k, s, p, op = r["kernel"], r["stride"], r["padding"], r["output_padding"]
        assert (k, s, p, op) in cs.LAYER_KINDS
        assert 1 <= r["c_out"] <= 2 * c_in
        assert (h - 1) * s - 2 * p + k + op >= 1
        assert r["gflop"] <= 10.0
        assert r["precision"] in ("bf16", "tf32")
        assert r["layout"] in ("nchw", "cl")
        assert max(n * c_in * h * w, c_in * r["c_out"] * k * k) * 4 <= cs.MAX_BYTES


def test_summary_counts_against_the_targets() -> None:
    def row(i: int, ratio: float, tune_s: float) -> dict:
        return {"half": "fit" if i % 2 == 0 else "held-out", "ratio": ratio, "tune_s": tune_s, "measured_ms": 0.1}

    rows = [row(i, r, t) for i, (r, t) in enumerate([(1.0, 0.05), (1.1, 0.1), (1.2, 0.2), (2.0, 0.4)])]
    s = cs.summary(rows)
    assert s["all"]["layers"] == 4
    assert s["all"]["within_1.15"] == 0.5
    assert s["all"]["worse_than_1.5"] == 1
    assert s["all"]["ratio_max"] == 2.0
    assert s["all"]["tune_s_total"] == 0.8
    assert s["fit"]["layers"] == s["held-out"]["layers"] == 2
    assert s["held-out"]["worse_than_1.5"] == 1
    assert cs.summary([])["all"] == {}
