"""Sharded-versus-unsharded checks on fake CPU devices, run as a subprocess by test_sharding.py.

JAX fixes its device count when it starts, and the pytest process has started it with one CPU
device, so the checks run here with `XLA_FLAGS=--xla_force_host_platform_device_count=8`:

  python sharding_checks.py single DIR PART    the single-process checks of PART (0 or 1: two
                                                halves, run side by side); one JSON line each
  python sharding_checks.py worker DIR ID PORT  process ID of 2 (4 devices each) of the multi-host
                                                check, coordinated through localhost:PORT

The tiny checkpoints are written straight as safetensors from the parameter table's HF names,
with random weights spread out like tests/tiny_models.py (decisive greedy margins). Parity with
transformers is test_parity's job; here the reference is jaxllm on one device.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import traceback
from pathlib import Path

import numpy as np

VOCAB = 256
# One layer unless the variant needs more: every case compiles forward and generate twice (sharded
# and not), and the compile time on 8 fake CPU devices is most of this file's run time.
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
             rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False, hidden_act="silu")

# name -> HF config.json overrides of _BASE
VARIANTS: dict[str, dict] = {
    "llama_k4": dict(model_type="llama"),
    "llama_k2": dict(model_type="llama", num_key_value_heads=2, num_hidden_layers=2),
    "llama_tied": dict(model_type="llama", num_attention_heads=4, tie_word_embeddings=True),
    # q/k/v biases repeated with their KV heads, and the o bias added once after the psum.
    "llama_bias": dict(model_type="llama", num_key_value_heads=2, attention_bias=True),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=True),  # per-head q/k norms
    # SmolLM2's head counts (K 3, G 3): on 2 devices attention cannot split, on 3 the vocab cannot.
    "odd_heads": dict(model_type="llama", hidden_size=72, num_attention_heads=9, num_key_value_heads=3),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    # 6 KV heads on 4 devices: repeated twice, 3 per device (the checkpoint restore's general path).
    "llama_k6": dict(model_type="llama", hidden_size=96, num_attention_heads=12, num_key_value_heads=6),
    # Layer 1 sparse, layer 0 dense.
    "qwen3_moe": dict(model_type="qwen3_moe", num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, decoder_sparse_step=2, norm_topk_prob=True),
    # Post-norms after the psums, scores capped per device, logits capped split over the vocab.
    "gemma2": dict(model_type="gemma2", num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
    # A sliding layer rotating with its own base, then a global one; (1 + w) q/k norms.
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, sliding_window=4, rope_local_base_freq=100.0,
                   layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True),
}

# (variant, tp, data, expert_parallel, expected TensorParallel fields)
CASES = [
    ("llama_k4", 4, 1, False, dict(heads=True, ffn=True, vocab=True, kv_replicas=1)),
    ("llama_k4", 2, 1, False, dict(heads=True, ffn=True, vocab=True, kv_replicas=1)),
    ("llama_k2", 4, 1, False, dict(heads=True, kv_replicas=2)),  # 2 KV heads on 4 devices
    ("llama_tied", 4, 1, False, dict(heads=True, vocab=True, kv_replicas=1)),
    ("llama_bias", 4, 1, False, dict(heads=True, kv_replicas=2)),
    ("qwen3", 4, 1, False, dict(heads=True, vocab=True, kv_replicas=2)),
    ("odd_heads", 2, 1, False, dict(heads=False, ffn=True, vocab=True)),
    ("odd_heads", 3, 1, False, dict(heads=True, ffn=True, vocab=False)),
    ("mixtral", 4, 1, True, dict(experts=True, expert_ffn=False)),  # expert parallel
    ("qwen3_moe", 4, 1, False, dict(experts=False, expert_ffn=True, ffn=True)),  # experts' F split
    ("llama_k4", 4, 2, False, dict(heads=True)),  # a ("data", "tp") mesh of 8
    ("gemma2", 4, 1, False, dict(heads=True, ffn=True, vocab=True, kv_replicas=1)),
    ("gemma3", 4, 1, False, dict(heads=True, vocab=True, kv_replicas=2)),
]
# The public prefill and its cache shards (one more compilation each): these cases only.
PREFILL_CASES = {("llama_k2", 4, 1), ("llama_k4", 4, 2)}


def case_name(variant, tp, data, expert_parallel, _=None) -> str:
    return f"{variant}-tp{tp}" + (f"-data{data}" if data > 1 else "") + ("-ep" if expert_parallel else "")


def hf_config(variant: str) -> dict:
    return {**_BASE, **VARIANTS[variant]}


def write_checkpoint(directory: Path, hf: dict, seed: int = 0) -> Path:
    """config.json + model.safetensors of random weights for every tensor the config needs."""
    from safetensors.numpy import save_file

    from jaxllm import families
    from jaxllm.model.params import named_specs

    cfg = families.config_from_hf(hf)
    names = {n: shape for _, s in named_specs(cfg) for n, shape in families.of(cfg).hf_sources(s)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in sorted(names.items()):
        noise = rng.standard_normal(shape).astype(np.float32)
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.2 * noise
        elif name.endswith(".bias"):
            tensors[name] = 0.2 * noise
        elif "embed_tokens" in name:
            tensors[name] = 0.5 * noise
        else:  # [out, in] projections and routers
            tensors[name] = noise * np.float32(1.5 / math.sqrt(shape[-1]))
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf))
    return directory


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, VOCAB, n)) for n in (5, 12)]


def rel_err(actual, reference) -> float:
    actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
    assert actual.shape == reference.shape, (actual.shape, reference.shape)
    return float(np.abs(actual - reference).max() / np.abs(reference).max())


# --- single process, 8 devices --------------------------------------------------------------------


def _check_shards(params, tp):
    """Every parameter's first shard has the global shape with each split axis divided by tp."""
    import jax

    from jaxllm.model import sharding

    specs = jax.tree.leaves(sharding.param_specs(params.config, params.tp))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    assert len(specs) == len(leaves)
    split = 0
    for (path, x), spec in zip(leaves, specs):
        want = tuple(n // tp if s == sharding.TP else n for n, s in zip(x.shape, tuple(spec) + (None,) * 9))
        got = x.addressable_shards[0].data.shape
        assert got == want, (jax.tree_util.keystr(path), x.shape, got, want)
        split += want != x.shape
    return split


def check_case(root: Path, variant, tp, data, expert_parallel, expected) -> str:
    import jax
    import jax.numpy as jnp

    import jaxllm
    from jaxllm.model import sharding

    path = root / variant
    ref = _reference(path)
    mesh = sharding.make_mesh(tp, data)
    params = jaxllm.load(path, dtype="float32", mesh=mesh, expert_parallel=expert_parallel)
    got = {k: getattr(params.tp, k) for k in expected}
    assert got == expected, f"plan {got} != expected {expected}"
    split = _check_shards(params, tp)
    cfg = params.config
    assert cfg.num_kv_heads == ref.params.config.num_kv_heads * params.tp.kv_replicas

    tokens = np.random.default_rng(1).integers(3, VOCAB, (2, 12)).astype(np.int32)
    logits = jaxllm.forward(params, tokens)
    err = rel_err(logits, ref.logits)
    assert err < 1e-5, f"forward logits differ: rel err {err:.2e}"

    out = jaxllm.generate(params, prompts(), max_new_tokens=16, eos_token_ids=())
    np.testing.assert_array_equal(np.asarray(out.tokens), ref.tokens, err_msg="generated tokens differ")
    np.testing.assert_array_equal(np.asarray(out.lengths), ref.lengths)

    # The public prefill, and its KV cache split by KV head like the weights (and rows over "data").
    if (variant, tp, data) in PREFILL_CASES:
        cache = jaxllm.init_cache(cfg, 2, 32, jnp.float32)
        last, cache = jaxllm.prefill(params, tokens, cache)
        want = (2 // data, cfg.num_kv_heads // tp, 32, cfg.head_dim)
        assert cache.k[0].addressable_shards[0].data.shape == want, (cache.k[0].sharding, want)
        err = rel_err(last, ref.logits[:, -1])
        assert err < 1e-5, f"prefill logits differ: rel err {err:.2e}"
    per_device = sharding.per_device_bytes(params)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return f"{split} tensors split, per device {per_device} of {total} bytes, logits err {err:.1e}"


class _Ref:
    pass


_refs: dict[Path, _Ref] = {}


def _reference(path: Path) -> _Ref:
    import jaxllm

    if path not in _refs:
        if not (path / "config.json").exists():
            write_checkpoint(path, hf_config(path.name))
        r = _Ref()
        r.params = jaxllm.load(path, dtype="float32")
        tokens = np.random.default_rng(1).integers(3, VOCAB, (2, 12)).astype(np.int32)
        r.logits = np.asarray(jaxllm.forward(r.params, tokens))
        out = jaxllm.generate(r.params, prompts(), max_new_tokens=16, eos_token_ids=())
        r.tokens, r.lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        _refs[path] = r
    return _refs[path]


def check_sampling_and_stream(root: Path) -> str:
    """Temperature with top-k/top-p/min-p and a repetition penalty, and `stream`, as unsharded."""
    from unittest import mock

    import jaxllm
    from jaxllm.engine import memory
    from jaxllm.model import sharding

    ref = _reference(root / "llama_k2")
    params = jaxllm.load(root / "llama_k2", dtype="float32", mesh=sharding.make_mesh(4))
    kw = dict(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.3,
              eos_token_ids=(), seed=3)
    want = jaxllm.generate(ref.params, prompts(), **kw)
    got = jaxllm.generate(params, prompts(), **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    # With memory figures (none on a CPU), stream compiles its sharded prefill for XLA's count.
    counted, count = [], memory.program_bytes
    with mock.patch.object(memory, "memory_stats", lambda device: {"bytes_limit": 1 << 40}), \
            mock.patch.object(memory, "program_bytes", lambda c: counted.append(count(c)) or counted[-1]):
        streamed = list(jaxllm.stream(params, prompts()[1], max_new_tokens=10, eos_token_ids=()))
    assert streamed == list(ref.tokens[1, :10]), (streamed, ref.tokens[1, :10])
    assert len(counted) == 1 and counted[0] > 0, counted
    return "sampled and streamed tokens equal"


def _tiny_llama(vocab_size: int = 256, num_layers: int = 2):
    """A small Llama config whose heads, KV heads and FFN split 4 ways."""
    from jaxllm.model.config import ModelConfig
    return ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=64,
                       num_layers=num_layers, num_heads=8, num_kv_heads=4, head_dim=16, ffn_size=96,
                       max_position_embeddings=256)


def check_no_logits_gather() -> str:
    """Greedy generation over a vocab-split lm_head never gathers [B, V] logits to one device."""
    import jax
    import jax.numpy as jnp

    import jaxllm
    from jaxllm.engine.sampling import SamplingConfig
    from jaxllm.model import sharding

    gen = sys.modules["jaxllm.engine.generate"]
    V, tp, B = 8192, 4, 2
    cfg = _tiny_llama(vocab_size=V, num_layers=1)
    params = sharding.init_sharded(cfg, jax.random.key(0), sharding.make_mesh(tp), jnp.float32)
    s = SamplingConfig()
    hlo = gen._generate_core.lower(
        params, jnp.zeros((B, 16), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.int32(8),
        gen._stop_array([2]), s.values(B), cache_length=32, steps=16, flags=s.static()).compile().as_text()
    gathers = re.findall(r"= (\w+)\[([\d,]*)\][^=]*? all-gather\(", hlo)
    assert gathers, "no all-gather at all: is the lm_head split?"
    sizes = [math.prod(int(d) for d in dims.split(",") if d) for _, dims in gathers]
    assert max(sizes) < V // tp, f"an all-gather of {max(sizes)} elements: logits gathered? {gathers}"
    return f"all-gathers of {sorted(set(sizes))} elements (V/tp = {V // tp})"


def check_init_sharded() -> str:
    """Random weights drawn into their shards tensor by tensor hold init_params' values (to the
    last bit or so: XLA may fuse the scaling differently), split."""
    import jax
    import jax.numpy as jnp

    from jaxllm.model import sharding
    from jaxllm.model.params import init_params

    cfg = _tiny_llama()
    params = sharding.init_sharded(cfg, jax.random.key(5), sharding.make_mesh(4), jnp.float32)
    whole = init_params(cfg, jax.random.key(5), jnp.float32)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(whole)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=0)
    shards = {s.data.shape for s in params.layers[1].w_down.addressable_shards}
    assert shards == {(64, 24)}, shards  # F split 4 ways
    return f"{len(jax.tree.leaves(params))} tensors equal; w_down shards {shards}"


def check_trace_collectives(root: Path) -> str:
    """A trace of a sharded generate: the summary gives the collectives their share, by name."""
    import jax
    import jax.numpy as jnp

    import jaxllm
    from jaxllm.model import sharding
    from jaxllm.tools.trace import trace_steady

    cfg = _tiny_llama()
    params = sharding.init_sharded(cfg, jax.random.key(1), sharding.make_mesh(4), jnp.float32)
    info = trace_steady(lambda: jaxllm.generate(params, [[3, 1, 4, 1, 5]], max_new_tokens=4),
                        root / "trace")
    summary = info.summary(top=None)
    psums = [op for op in summary if op.scope.endswith("psum")]
    assert psums and 0 < summary.collectives < 1, (summary.collectives, [op.name for op in summary][:20])
    assert summary.collectives >= sum(op.share for op in psums) - 1e-9
    assert "collectives" in str(summary)
    return f"collectives {summary.collectives:.1%} of op time; {len(psums)} psum ops"


def check_70b_abstract() -> str:
    """Llama-3-70B and Mixtral-8x7B shapes sharded 8 ways fit one H200 each, without allocating."""
    import jax
    import jax.numpy as jnp

    from jaxllm.model import sharding
    from jaxllm.model.cache import KVCache
    from jaxllm.model.params import abstract_params, param_bytes
    from jaxllm.model.transformer import step
    from jaxllm.tools.presets import PRESETS

    mesh = sharding.make_mesh(8)
    lines = []
    for name, ep in (("llama3-70b", False), ("mixtral-8x7b", False), ("mixtral-8x7b", True)):
        cfg = PRESETS[name]
        params = sharding.abstract_sharded(cfg, mesh, jnp.bfloat16, expert_parallel=ep)
        total, per_device = param_bytes(abstract_params(cfg)), sharding.per_device_bytes(params)
        # Only the norm vectors (and Mixtral's router) are replicated.
        assert per_device < total / 8 * 1.001, (name, per_device, total)
        assert per_device < 141e9 * 0.5, (name, per_device)
        B, S = 8, 4096
        specs = sharding.cache_specs(params.tp, cfg.num_layers)
        kv = jax.ShapeDtypeStruct((B, params.config.num_kv_heads, S, cfg.head_dim), jnp.bfloat16,
                                  sharding=jax.sharding.NamedSharding(mesh, specs.k[0]))
        cache = KVCache(k=[kv] * cfg.num_layers, v=[kv] * cfg.num_layers,
                        start=jax.ShapeDtypeStruct((B,), jnp.int32), end=jax.ShapeDtypeStruct((B,), jnp.int32))
        logits, new_cache = jax.eval_shape(step, params, jax.ShapeDtypeStruct((B, 1), jnp.int32), cache)
        assert logits.shape == (B, cfg.vocab_size) and new_cache.k[0].shape == kv.shape
        cache_dev = 2 * cfg.num_layers * math.prod(kv.sharding.shard_shape(kv.shape)) * 2
        lines.append(f"{name}{' ep' if ep else ''}: {total / 1e9:.1f} GB -> {per_device / 1e9:.2f} GB/device "
                     f"(+ KV cache B{B} S{S}: {cache_dev / 1e9:.2f} GB/device)")
    return "; ".join(lines)


def check_checkpoint(root: Path) -> str:
    """`jaxllm convert` output restored onto other meshes equals loading the HF checkpoint there."""
    import jax

    import jaxllm
    from jaxllm.cli.convert import convert
    from jaxllm.model import sharding

    def same(a, b):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert x.shape == y.shape and x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert a.config == b.config and a.tp == b.tp

    lines = []
    for variant, save_tp, tps in (("llama_k2", 2, (None, 4, 8)), ("llama_k6", None, (4,))):
        src = root / variant
        if not (src / "config.json").exists():
            write_checkpoint(src, hf_config(variant))
        dst = convert(src, root / f"{variant}_orbax", dtype="float32",
                                 mesh=None if save_tp is None else sharding.make_mesh(save_tp))
        for tp in tps:
            mesh = None if tp is None else sharding.make_mesh(tp)
            restored = jaxllm.load(dst, dtype="float32", mesh=mesh)
            same(restored, jaxllm.load(src, dtype="float32", mesh=mesh))
            lines.append(f"{variant} saved on {save_tp or 1}, restored on {tp or 1}"
                         + (f" (KV heads x{restored.tp.kv_replicas})" if tp else ""))
    ref = _reference(root / "llama_k2")
    tokens = np.random.default_rng(1).integers(3, VOCAB, (2, 12)).astype(np.int32)
    err = rel_err(jaxllm.forward(jaxllm.load(root / "llama_k2_orbax", dtype="float32",
                                             mesh=sharding.make_mesh(4)), tokens), ref.logits)
    assert err < 1e-5, err
    return "; ".join(lines) + ": equal to direct loads"


def check_decode_kernel_sharded(root: Path) -> str:
    """The Pallas decode-attention kernel (in its interpreter here) runs inside shard_map, on
    each device's KV heads, and the sharded model decodes the unsharded path's tokens. Qwen3
    (head norms in the kernel) on 4 devices."""
    import dataclasses

    import jax

    import jaxllm
    from jaxllm import kernels
    from jaxllm.kernels import tuning
    from jaxllm.model import sharding

    path = root / "qwen3"
    ref = _reference(path)
    calls = []
    real = kernels.decode_attention

    def spy(*args, **kwargs):
        calls.append(args[1].shape)  # the device's cache [B, K, S, H]
        return real(*args, **kwargs)

    stands = tuning.TUNING
    tuning.TUNING = dataclasses.replace(stands, decode_attention="interpret")
    kernels.decode_attention = spy
    jax.clear_caches()
    try:
        params = jaxllm.load(path, dtype="float32", mesh=sharding.make_mesh(4))
        out = jaxllm.generate(params, prompts(), max_new_tokens=16, eos_token_ids=())
    finally:
        tuning.TUNING, kernels.decode_attention = stands, real
        jax.clear_caches()
    K = params.config.num_kv_heads
    assert calls and all(shape[1] == K // 4 for shape in calls), (calls, K)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref.tokens, err_msg="generated tokens differ")
    return f"tokens equal the unsharded path's; the kernel ran on {K // 4} of {K} KV heads a device"


def check_explicit_mesh(root: Path) -> str:
    """A mesh from jax.make_mesh (Explicit axes by default) loads and generates as make_mesh's
    (Auto axes); it loaded, then every call failed in shard_map's in_specs. Bad sizes are named."""
    import jax
    import pytest

    import jaxllm
    from jaxllm.model import sharding

    path = root / "llama_k2"
    if not (path / "config.json").exists():
        write_checkpoint(path, hf_config("llama_k2"))
    want = jaxllm.generate(jaxllm.load(path, dtype="float32", mesh=sharding.make_mesh(2)), prompts(),
                           max_new_tokens=8, eos_token_ids=()).tokens
    explicit = jax.make_mesh((2,), (sharding.TP,))
    got = jaxllm.generate(jaxllm.load(path, dtype="float32", mesh=explicit), prompts(), max_new_tokens=8,
                          eos_token_ids=()).tokens
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for bad, error, message in ((2.5, TypeError, "whole numbers"), ("2", TypeError, "whole numbers"),
                                (None, TypeError, "whole numbers"), (0, ValueError, ">= 1")):
        with pytest.raises(error, match=message):
            sharding.make_mesh(bad)
    with pytest.raises(ValueError, match="the list given is empty"):
        sharding.make_mesh(1, devices=[])
    return f"{explicit.axis_types} axes load and generate as Auto ones"


def _checks(root: Path) -> list[tuple[str, object]]:
    checks = [(case_name(*c), (lambda c=c: check_case(root, *c))) for c in CASES]
    return checks + [("sampling_and_stream", lambda: check_sampling_and_stream(root)),
                     ("decode_kernel_sharded", lambda: check_decode_kernel_sharded(root)),
                     ("checkpoint", lambda: check_checkpoint(root)),
                     ("explicit_mesh", lambda: check_explicit_mesh(root)),
                     ("no_logits_gather", check_no_logits_gather), ("abstract_70b", check_70b_abstract),
                     ("init_sharded", check_init_sharded),
                     ("trace_collectives", lambda: check_trace_collectives(root))]


CHECK_NAMES = [name for name, _ in _checks(Path())]
# Two halves for two processes, each variant's cases (and its reference compilations) in one.
_FIRST_HALF = {"llama_k4", "llama_tied", "qwen3", "mixtral", "abstract_70b", "decode_kernel_sharded",
               "gemma2"}


def part_of(name: str) -> int:
    return 0 if name.split("-")[0] in _FIRST_HALF else 1


def single(root: Path, part: int):
    import jax
    assert jax.device_count() == 8, jax.devices()
    for name, run in _checks(root):
        if part_of(name) != part:
            continue
        t = time.perf_counter()
        try:
            detail, ok = run(), True
        except Exception:  # noqa: BLE001 - reported to the parent test, which fails on it
            detail, ok = traceback.format_exc(), False
        print(json.dumps(dict(name=name, ok=ok, detail=detail, seconds=round(time.perf_counter() - t, 2))),
              flush=True)


# --- multi-host: 2 processes x 4 devices -----------------------------------------------------------


def worker(root: Path, process_id: int, port: int):
    import jax
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=60)
    import jaxllm
    from jaxllm.model import sharding

    assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
    path = root / "llama_k2"
    params = jaxllm.load(path, dtype="float32", mesh=sharding.make_mesh(8))
    local = {d.process_index for s in params.embed.addressable_shards for d in [s.device]}
    assert local == {process_id}, local
    out = jaxllm.generate(params, prompts(), max_new_tokens=16, eos_token_ids=())
    alone = jaxllm.generate(jaxllm.load(path, dtype="float32"), prompts(), max_new_tokens=16, eos_token_ids=())
    print(json.dumps(dict(process=process_id, tokens=np.asarray(out.tokens).tolist(),
                          lengths=np.asarray(out.lengths).tolist(),
                          unsharded=np.asarray(alone.tokens).tolist(),
                          kv_replicas=params.tp.kv_replicas)), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "single":
        single(root, int(sys.argv[3]))
    elif mode == "worker":
        worker(root, int(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
