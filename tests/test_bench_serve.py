"""scripts/bench_serve.py's smoke run: a few requests on the tiny preset, every mode."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench_serve(*args) -> list[dict]:
    """bench_serve's JSON lines for `args` on the CPU (the run must succeed)."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serve.py"), *args], capture_output=True,
                         text=True, timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.slow
def test_bench_serve_runs_every_mode_on_the_same_requests():
    lines = _bench_serve("--preset", "tiny", "--requests", "6", "--max-slots", "4", "--max-context", "128",
                         "--prefill-chunk", "32", "--input-len", "4,48", "--output-len", "2,16", "--rate", "50",
                         "--mode", "static,http-thread,engine,http", "--disconnects", "0")
    assert [line["mode"] for line in lines] == ["http", "engine", "http-thread", "static"]
    tokens = {line["output_tokens"] for line in lines}
    assert len(tokens) == 1 and tokens.pop() > 6  # every mode made every request's tokens
    for line in lines:
        assert line["errors"] == [] and line["ttft_ms_p50"] > 0
    for line in lines[:3]:
        assert line["compilations_during_run"] == 0
        assert line["decode_steps"] > 0 and 0 < line["mean_occupancy"] <= 1
        assert line["mean_occupancy"] * line["max_slots"] <= line["mean_computed_rows"] <= line["max_slots"]
        assert line["chunk_calls"] > 0  # prompts over 32 tokens went in chunks
        # one iteration in 16 timed alone: the device's share of a step, beside the wall's
        assert line["device_timed_steps"] > 0 and line["device_ms_per_step"] > 0 and line["wall_over_device"] > 0


@pytest.mark.slow
def test_bench_serve_fake_device_runs_the_host_side_alone():
    """--fake-device, at two rates in one run (a line each rate and mode, the same requests)."""
    lines = _bench_serve("--preset", "tiny", "--requests", "12", "--max-slots", "4", "--max-context", "128",
                         "--prefill-chunk", "32", "--input-len", "4,48", "--output-len", "2,16", "--fake-device", "1",
                         "--mode", "engine,http", "--rate", "400,800", "--disconnects", "0")
    assert [(line["mode"], line["rate"]) for line in lines] == [("http", 400), ("http", 800), ("engine", 400),
                                                               ("engine", 800)]
    for line in lines:
        assert line["errors"] == [] and line["fake_device_ms"] == 1
        assert line["output_tokens"] == lines[0]["output_tokens"] > 12
        # a fake call takes 1 ms exactly: the device's share is counted, not sampled (a mixed step is
        # one call that counts as a decode step and a prefill call)
        calls = line["decode_steps"] + line["prefill_calls"] + line["chunk_calls"] - line["mixed_steps"]
        assert line["device_ms_per_step"] == round(calls / line["decode_steps"], 4)


@pytest.mark.slow
def test_bench_serve_times_the_row_of_a_stream_that_leaves():
    """Streams that close after 8 of their 112 tokens, on a fake device of 20 ms a step: each row is
    free long before the 104 steps it had left (about 2 s), and the line says by how much."""
    lines = _bench_serve("--preset", "tiny", "--requests", "2", "--max-slots", "2", "--max-context", "128",
                         "--prefill-chunk", "32", "--input-len", "4,8", "--output-len", "2,4", "--fake-device", "20",
                         "--mode", "http", "--disconnects", "2")
    assert [line["mode"] for line in lines] == ["http", "http-disconnect"]
    line = lines[1]
    assert line["disconnects"] == 2 and line["slots_in_use_after"] == 0 and line["errors"] == []
    assert line["step_ms_p50"] >= 15
    assert 0 < line["free_ms_p50"] <= line["free_ms_max"] < 1000


@pytest.mark.slow
def test_bench_serve_speculates_with_a_draft_preset():
    """--draft-preset: the engine speculates with a random draft, and the line says so."""
    # one slot, one prompt width, no chunks: the fewest programs to compile
    (line,) = _bench_serve("--preset", "tiny", "--requests", "3", "--max-slots", "1", "--max-context", "16",
                           "--prefill-chunk", "16", "--input-len", "4,8", "--output-len", "4,8",
                           "--draft-preset", "tiny", "--num-speculative", "2", "--mode", "engine")
    assert line["errors"] == [] and line["speculate"] == "tiny" and line["num_speculative"] == 2
    assert line["spec_steps"] > 0 and line["spec_proposed"] >= line["spec_accepted"] >= 0
    assert line["compilations_during_run"] == 0


@pytest.mark.slow
def test_bench_serve_max_concurrency_one_is_a_lone_stream():
    """--max-concurrency 1: requests that arrive together are sent one after another, so every
    decode step runs one row (the single-stream latency the serving issue compares with bench.py)."""
    lines = _bench_serve("--preset", "tiny", "--requests", "4", "--max-slots", "4", "--max-context", "128",
                         "--prefill-chunk", "32", "--input-len", "4,16", "--output-len", "4,16", "--fake-device", "1",
                         "--mode", "engine,http", "--max-concurrency", "1", "--disconnects", "0")
    assert [line["mode"] for line in lines] == ["http", "engine"]
    for line in lines:
        assert line["errors"] == [] and line["max_concurrency"] == 1
        assert line["mean_occupancy"] * line["max_slots"] == pytest.approx(1)
