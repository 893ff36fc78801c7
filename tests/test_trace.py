"""Profiler traces, their summary, the recompile warning and the persistent compilation cache (CPU)."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxllm
from jaxllm.tools.trace import RecompileWarning, is_collective, kernel_view, summarize, trace, trace_steady
from compile_counting import compilations

gen = importlib.import_module("jaxllm.engine.generate")  # the module; `jaxllm.generate` is the function



def tiny_config(vocab: int) -> jaxllm.ModelConfig:
    # Each test that counts compilations gets its own vocabulary size: a config no other test
    # has compiled for, so the first compilation is really its own.
    return jaxllm.ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=32, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=8, ffn_size=64,
                              max_position_embeddings=256)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A steady-state trace of one generate call of a tiny random model."""
    params = jaxllm.init_params(tiny_config(96), jax.random.key(0), jnp.float32)
    log_dir = tmp_path_factory.mktemp("trace")
    info = trace_steady(lambda: jaxllm.generate(params, [[3, 1, 4, 1, 5]], max_new_tokens=8), log_dir)
    return info


def test_trace_is_written_with_the_model_scopes(traced):
    run = traced.run_dir
    assert run is not None and run.parent == traced.log_dir / "plugins" / "profile"
    xplane = list(run.glob("*.xplane.pb"))
    assert xplane and list(run.glob("*.trace.json.gz"))
    # The HLO stored in the trace names every op's named scope.
    blob = xplane[0].read_bytes()
    for scope in (b"layer_0", b"layer_1", b"attention", b"mlp", b"lm_head", b"sampling", b"prefill",
                  b"decode"):
        assert scope in blob, scope
    # The Perfetto copy is plain Chrome-trace JSON without the metadata Perfetto rejects.
    with gzip.open(traced.perfetto_file, "rt") as f:
        perfetto = json.load(f)
    assert "metadata" not in perfetto and len(perfetto["traceEvents"]) > 10
    assert str(traced.log_dir) in traced.how_to_open()
    assert traced.output.tokens.shape == (1, 8)


@pytest.mark.slow
def test_summary_lists_real_ops_with_their_scopes(traced):
    every = summarize(traced.log_dir, top=None)
    assert sum(op.share for op in every) == pytest.approx(1.0, abs=1e-6)
    assert sum(op.seconds for op in every) == pytest.approx(every.total_s)
    assert all(op.seconds > 0 for op in every)
    with gzip.open(next(traced.run_dir.glob("*.trace.json.gz")), "rt") as f:
        traced_ops = {e["args"]["hlo_op"] for e in json.load(f)["traceEvents"]
                      if "hlo_op" in e.get("args", {})}
    assert {op.name for op in every} <= traced_ops
    # Loops are not ops of their own: their bodies' ops carry the time.
    assert not any(op.name.startswith("while") for op in every)
    scopes = {op.scope for op in every}
    for want in ("prefill/layer_0/attention", "decode/layer_1/mlp", "decode/lm_head", "sampling"):
        assert any(s.startswith(want) for s in scopes), want
    for key in ("prefill", "decode", "attention", "mlp", "lm_head", "sampling"):
        assert every.scopes.get(key, 0) > 0, key
    assert sum(every.scopes.get(k, 0) for k in ("prefill", "decode", "other phase")) == pytest.approx(1.0)
    assert set(every.layers) == {"layer_0", "layer_1"}
    assert every.collectives == 0 and "collectives" not in str(every)  # one device: none

    top = summarize(traced.log_dir, top=5)
    assert [op.name for op in top] == [op.name for op in every[:5]]
    text = str(top)
    assert top[0].name in text and "attention" in text and "%" in text


def test_collectives_are_told_by_opcode_or_by_the_primitive_ending_their_scope():
    # On a GPU a small all-reduce is a fusion named after its psum, running XLA's one-shot kernel.
    assert is_collective("fusion", "decode/shard_map/layer_0/attention/psum")
    assert is_collective("all-gather-start", "")
    assert is_collective("all-reduce", "prefill/shard_map/psum")
    assert not is_collective("fusion", "decode/shard_map/layer_0/mlp/mul")
    assert not is_collective("fusion", "decode/layer_0/mlp/psum_like")  # the primitive's whole name


@pytest.mark.slow
def test_programs_of_one_name_are_told_apart(tmp_path):
    # The prefill and the decode step are both the program `jit_step`, and many op names occur in
    # both: a trace of one must not borrow the other's scopes.
    params = jaxllm.init_params(tiny_config(96), jax.random.key(0), jnp.float32)
    tokens = jaxllm.stream(params, [1, 2, 3, 4, 5], max_new_tokens=12)  # cache of 16 + 16 slots
    next(tokens), next(tokens)  # prefill and the first decode step compile outside the traces
    with trace(tmp_path / "decode"):
        assert len(list(tokens)) == 10
    decode = summarize(tmp_path / "decode", top=None)
    assert decode.scopes.get("prefill", 0) == 0 and decode.scopes["decode"] > 0.5

    cache = jaxllm.init_cache(params.config, 1, 32, jnp.float32)
    prompt = jnp.ones((1, 16), jnp.int32)
    jax.block_until_ready(jaxllm.prefill(params, prompt, cache))  # the same program as stream's
    with trace(tmp_path / "prefill"):
        jax.block_until_ready(jaxllm.prefill(params, prompt, cache))
    prefill = summarize(tmp_path / "prefill", top=None)
    assert prefill.scopes.get("decode", 0) == 0 and prefill.scopes["prefill"] > 0.5


def test_kernels_replayed_from_a_command_buffer_get_their_own_layer():
    # As recorded on a GPU: each kernel of a CUDA-graph replay names the buffer as its op, and XLA
    # compiled one kernel for both layers' identical fusions, so the names repeat.
    from jaxllm.tools.trace import _Module, _attribute
    scopes = {"loop_add_fusion": "decode/layer_0/attention/add",
              "input_reduce_fusion": "decode/layer_0/mlp/dot",
              "loop_add_fusion.1": "decode/layer_1/attention/add",
              "input_reduce_fusion.1": "decode/layer_1/mlp/dot",
              "custom-call.1": "decode/layer_0/mlp/dot_general", "p": "", "while.1": ""}
    opcodes = {"custom-call.1": "custom-call", "p": "parameter", "while.1": "while"}
    schedule = ["p", "loop_add_fusion", "input_reduce_fusion", "custom-call.1", "loop_add_fusion.1",
                "input_reduce_fusion.1"]
    module = _Module("jit_step", {n: (sc, opcodes.get(n, "fusion")) for n, sc in scopes.items()},
                     [schedule, ["while.1"]])
    kernels = ["loop_add_fusion", "input_reduce_fusion", "sm90_xmma_gemm_bf16", "loop_add_fusion",
               "input_reduce_fusion"]
    timed = [({"name": k, "ts": float(t), "pid": 1, "tid": 7,
               "args": {"hlo_module": "jit_step", "hlo_op": "command_buffer_3", "correlation_id": str(step)}},
              1e-6 * (t + 1))
             for step in range(2) for t, k in enumerate(kernels)]
    times = _attribute(timed, {"jit_step": [module]})
    us = 1e-6
    assert times == pytest.approx({
        (module, "loop_add_fusion"): 2 * us, (module, "input_reduce_fusion"): 4 * us,
        (module, "sm90_xmma_gemm_bf16"): 6 * us,  # a library kernel keeps its own name
        (module, "loop_add_fusion.1"): 8 * us, (module, "input_reduce_fusion.1"): 10 * us})


def test_pallas_kernels_in_a_command_buffer_get_their_own_layer():
    # As recorded on a GPU: a Pallas kernel is named after its pallas_call (XLA numbers distinct
    # compilations of one name, 'decode_project__1'), its instruction 'pallas_call.N' in the scope
    # '.../decode_project/pallas_call'; one compiled kernel serves every layer.
    from jaxllm.tools.trace import _Module, _attribute
    names = ["decode_project", "decode_attention", "decode_project"]
    blocks = ["attention", "attention", "mlp"]
    scopes = {f"pallas_call.{3 * layer + j}": f"decode/layer_{layer}/{blocks[j]}/{names[j]}/pallas_call"
              for layer in range(2) for j in range(3)}
    module = _Module("jit_step", {n: (sc, "custom-call") for n, sc in scopes.items()}, [list(scopes)])
    kernels = ["decode_project", "decode_attention", "decode_project__1"] * 2
    timed = [({"name": k, "ts": float(t), "pid": 1, "tid": 7,
               "args": {"hlo_module": "jit_step", "hlo_op": "command_buffer_1", "correlation_id": "9"}},
              1e-6 * (t + 1)) for t, k in enumerate(kernels)]
    times = _attribute(timed, {"jit_step": [module]})
    assert times == pytest.approx({(module, f"pallas_call.{t}"): 1e-6 * (t + 1) for t in range(6)})
    assert module.scope("pallas_call.5") == "decode/layer_1/mlp/decode_project/pallas_call"


@pytest.mark.slow
def test_detail_trace_is_harmless_on_cpu(tmp_path):
    params = jaxllm.init_params(tiny_config(96), jax.random.key(0), jnp.float32)
    tokens = jnp.asarray([[1, 2, 3]])
    jax.block_until_ready(jaxllm.forward(params, tokens))
    with trace(tmp_path, detail=True) as info:
        jax.block_until_ready(jaxllm.forward(params, tokens))
    assert info.run_dir is not None
    assert summarize(tmp_path).scopes.get("attention", 0) > 0


def test_summarize_refuses_a_directory_without_a_trace(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace.json.gz"):
        summarize(tmp_path)


@pytest.mark.slow
def test_same_bucket_compiles_nothing_and_a_new_bucket_warns_once():
    params = jaxllm.init_params(tiny_config(98), jax.random.key(1), jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.block_until_ready(jaxllm.generate(params, [[1] * 5], max_new_tokens=4))  # bucket 16
        assert not [w for w in caught if w.category is RecompileWarning], "the first compile is expected"

        with compilations() as compiled:
            jax.block_until_ready(jaxllm.generate(params, [[2] * 9], max_new_tokens=4))  # bucket 16
        assert compiled == []
        assert not [w for w in caught if w.category is RecompileWarning]

        with compilations() as compiled:
            jax.block_until_ready(jaxllm.generate(params, [[2] * 20], max_new_tokens=4))  # bucket 32
        assert any("_generate_core" in name for name in compiled)
        recompiles = [w for w in caught if w.category is RecompileWarning]
        assert len(recompiles) == 1
        message = str(recompiles[0].message)
        assert "generate" in message and "prompt bucket 32" in message and "cache 48" in message
        assert recompiles[0].filename == __file__  # points at the caller's line

        jax.block_until_ready(jaxllm.generate(params, [[2] * 30], max_new_tokens=4))  # bucket 32 again
        assert len([w for w in caught if w.category is RecompileWarning]) == 1


def test_stream_warns_once_for_a_new_bucket():
    params = jaxllm.init_params(tiny_config(99), jax.random.key(2), jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(jaxllm.stream(params, [1] * 5, max_new_tokens=2))
        list(jaxllm.stream(params, [1] * 7, max_new_tokens=2))
        assert not [w for w in caught if w.category is RecompileWarning]
        list(jaxllm.stream(params, [1] * 40, max_new_tokens=2))
        recompiles = [w for w in caught if w.category is RecompileWarning]
        assert len(recompiles) == 1 and "stream" in str(recompiles[0].message)
        assert "prompt bucket 64" in str(recompiles[0].message)


# --- the persistent compilation cache, in fresh processes (JAX fixes its cache per process) -----

FORWARD_ONCE = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, jaxllm
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
    cfg = jaxllm.ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, num_layers=1,
                             num_heads=2, num_kv_heads=1, head_dim=8, ffn_size=32,
                             max_position_embeddings=64)
    # Weights from numpy: random init would compile a program per parameter shape.
    shapes = jax.eval_shape(lambda: jaxllm.init_params(cfg, jax.random.key(0), jnp.float32))
    params = jax.tree.map(lambda a: np.full(a.shape, 0.01, a.dtype), shapes)
    jax.block_until_ready(jaxllm.forward(params, [[1, 2, 3]]))
    print("CACHE_DIR", jaxllm.io.compile_cache.directory())
    print("CACHE_HITS", len(hits))
""")


def run_forward(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE",
                        "JAXLLM_NO_COMPILE_CACHE", "JAXLLM_CACHE")}
    env.update(env_extra)
    env.setdefault("JAX_PLATFORMS", "cpu")
    done = subprocess.run([sys.executable, "-c", FORWARD_ONCE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def cache_entries(root) -> list:
    xla = root / "xla"
    return [p for p in xla.iterdir() if p.name.endswith("-cache")] if xla.is_dir() else []


@pytest.mark.slow
def test_compile_cache_is_on_by_default_and_reused(tmp_path):
    first = run_forward({"JAXLLM_CACHE": str(tmp_path)})
    assert f"CACHE_DIR {tmp_path / 'xla'}" in first.stdout
    entries = cache_entries(tmp_path)
    assert entries, "small programs are cached too"
    second = run_forward({"JAXLLM_CACHE": str(tmp_path)})
    hits = int(second.stdout.split("CACHE_HITS")[1])
    assert hits >= 1 and len(cache_entries(tmp_path)) == len(entries)


@pytest.mark.slow
def test_compile_cache_off_by_env(tmp_path):
    done = run_forward({"JAXLLM_CACHE": str(tmp_path), "JAXLLM_NO_COMPILE_CACHE": "1"})
    assert "CACHE_DIR None" in done.stdout
    assert cache_entries(tmp_path) == []


@pytest.mark.slow
def test_unwritable_cache_dir_means_no_cache_not_an_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    done = run_forward({"JAXLLM_CACHE": str(blocker / "sub")})  # cannot be created, even as root
    assert "CACHE_DIR None" in done.stdout
    assert "Warning" not in done.stderr and "Traceback" not in done.stderr


def test_generate_loops_on_the_host_while_a_trace_needs_its_kernels(monkeypatch):
    """A profiler shows no kernel of a loop recorded as one CUDA graph: under `kernel_view` (which
    `trace` and `trace_steady` open) generate compiles its loop the default way."""
    monkeypatch.delenv("JAXLLM_LOOP_GRAPH", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert gen._core() is gen._generate_core
    with kernel_view():
        assert gen._core() is gen._generate_core_host_loop
    assert gen._core() is gen._generate_core
    monkeypatch.setenv("JAXLLM_LOOP_GRAPH", "0")
    assert gen._core() is gen._generate_core_host_loop


# --- bad input: a ValueError or TypeError naming it, before any work ------------------------------


@pytest.mark.slow
def test_summarize_refuses_a_negative_or_non_integer_top(traced):
    every = summarize(traced.log_dir, top=None)
    assert len(summarize(traced.log_dir, top=len(every) + 5)) == len(every)
    with pytest.raises(ValueError, match="top must be >= 0, got -1"):  # not every op but the last
        summarize(traced.log_dir, top=-1)
    with pytest.raises(TypeError, match="top must be an integer"):
        summarize(traced.log_dir, top=2.5)
    with pytest.raises(TypeError, match="top must be an integer"):
        traced.summary(top="5")


def _gz(path, payload: bytes):
    with gzip.open(path, "wb") as f:
        f.write(payload)
    return path


@pytest.mark.slow
def test_summarize_names_a_file_that_is_no_chrome_trace(traced, tmp_path):
    xplane = next(traced.run_dir.glob("*.xplane.pb"))
    with pytest.raises(ValueError, match=r"xplane\.pb is not a gzipped Chrome trace.*run folder"):
        summarize(xplane)
    damaged = tmp_path / "damaged.trace.json.gz"
    damaged.write_bytes(next(traced.run_dir.glob("*.trace.json.gz")).read_bytes()[:200])  # cut short
    with pytest.raises(ValueError, match="damaged.trace.json.gz is not a gzipped Chrome trace"):
        summarize(damaged)
    garbage = tmp_path / "garbage.trace.json.gz"
    garbage.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4)  # a gzip header, then noise
    with pytest.raises(ValueError, match="garbage.trace.json.gz"):
        summarize(garbage)
    not_json = _gz(tmp_path / "text.trace.json.gz", b"hello")
    with pytest.raises(ValueError, match="text.trace.json.gz is not a gzipped Chrome trace"):
        summarize(not_json)
    for i, payload in enumerate([b"[1, 2]", b'{"traceEvents": {"a": 1}}', b'{"traceEvents": [1]}',
                                 b'{"traceEvents": [{"ph": "X", "dur": 3, "name": "x"}]}']):
        wrong = _gz(tmp_path / f"shape{i}.trace.json.gz", payload)
        with pytest.raises(ValueError, match=f"shape{i}.trace.json.gz"):
            summarize(wrong)


def test_trace_refuses_a_file_as_its_directory(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    with pytest.raises(ValueError, match=f"{a_file} exists and is not a directory"):
        with jaxllm.trace(a_file):
            pass
    with pytest.raises(ValueError, match="cannot make the trace directory"):
        with trace(a_file / "sub"):
            pass
    assert a_file.read_text() == "keep"


def test_trace_steady_refuses_bad_arguments_before_calling_anything(tmp_path):
    calls = []

    def fn():
        calls.append(1)
        return jnp.zeros(())
    for kwargs, error, message in [
            (dict(runs=0), ValueError, "runs must be >= 1, got 0"),
            (dict(runs=-1), ValueError, "runs must be >= 1, got -1"),
            (dict(runs=1.5), TypeError, "runs must be an integer"),
            (dict(warmup=-1), ValueError, "warmup must be >= 0"),
            (dict(warmup="1"), TypeError, "warmup must be an integer")]:
        with pytest.raises(error, match=message):
            trace_steady(fn, tmp_path / "t", **kwargs)
    with pytest.raises(TypeError, match="fn must be a function"):
        trace_steady(None, tmp_path / "t")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        trace_steady(fn, a_file)
    assert calls == [] and not (tmp_path / "t" / "plugins").exists()
