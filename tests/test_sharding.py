"""Tensor parallelism: the sharded model equals the unsharded one, on 8 fake CPU devices.

The device count is fixed when JAX starts, and this pytest process has started it with one CPU
device, so the sharded checks run in subprocesses (tests/sharding_checks.py, which documents
each): one process with 8 devices for every single-host check, reported check by check below, and
two processes of 4 devices each, joined by `jax.distributed.initialize` on localhost, for the
multi-host check. The rest (planning, errors, the unsharded path) runs here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jaxllm
import sharding_checks
from jaxllm.model import sharding
from jaxllm.model.transformer import step
from jaxllm.tools.presets import PRESETS

SCRIPT = Path(sharding_checks.__file__)


def _env(devices: int) -> dict:
    # Backend optimization off: it halves the compile time, which is most of the run time, and
    # the sharded and unsharded programs compared are compiled alike. The persistent compilation
    # cache stays out of it: fake-device programs have no business in the user's cache.
    flags = (f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0 "
             "--xla_llvm_disable_expensive_passes=true")
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "JAXLLM_NO_COMPILE_CACHE": "1"}


@pytest.fixture(scope="module")
def single_host(tmp_path_factory) -> dict:
    """Both halves of the checks side by side (two processes of 8 devices); {name: record}."""
    root = tmp_path_factory.mktemp("sharding")
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "single", str(root / str(part)), str(part)],
                              env=_env(8), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for part in (0, 1)]
    results, logs = {}, []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            logs.append(f"exit {proc.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}")
            for line in stdout.splitlines():
                if line.startswith("{"):
                    record = json.loads(line)
                    results[record["name"]] = record
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results["_log"] = "\n".join(logs)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", sharding_checks.CHECK_NAMES)
def test_sharded_on_8_devices(single_host, name):
    """See sharding_checks.check_case (tokens, logits, shard shapes) and the named checks."""
    record = single_host.get(name)
    assert record is not None, f"check {name} did not report:\n{single_host['_log']}"
    assert record["ok"], record["detail"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    """2 processes x 4 CPU devices, one mesh of 8 across them: the same tokens as one process."""
    sharding_checks.write_checkpoint(tmp_path / "llama_k2", sharding_checks.hf_config("llama_k2"))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "worker", str(tmp_path), str(i), str(port)],
                              env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=240)
            outs.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for code, stdout, stderr in outs:
        lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        assert code == 0 and lines, f"exit {code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
        results.append(lines[-1])
    assert [r["process"] for r in results] == [0, 1]
    assert results[0]["kv_replicas"] == 4  # 2 KV heads over 8 devices
    for r in results:
        assert r["tokens"] == r["unsharded"], r
        assert r["lengths"] == [16, 16]
    assert results[0]["tokens"] == results[1]["tokens"]


# --- in this process ------------------------------------------------------------------------------


def test_kv_replicas():
    cfg = PRESETS["tiny"]  # N 4, K 2
    assert [sharding.kv_replicas(cfg, tp) for tp in (1, 2, 4, 8)] == [1, 1, 2, 1]  # 8: G 2 < 4 copies
    llama = PRESETS["llama3-70b"]  # N 64, K 8
    assert [sharding.kv_replicas(llama, tp) for tp in (2, 8, 16, 32)] == [1, 1, 2, 4]
    smol = PRESETS["smollm2-135m"]  # N 9, K 3
    assert [sharding.kv_replicas(smol, tp) for tp in (2, 3, 9)] == [1, 1, 3]


def test_layout_keeps_query_heads_in_order():
    """Repeating KV heads: query head n stays head n; k and v of head k appear r times."""
    import numpy as np

    cfg = PRESETS["tiny"]  # K 2, G 2, H 16, D 64
    K, G, H, D = 2, 2, 16, 64
    wqkv = np.arange(K * (G + 2) * H * D, dtype=np.float32).reshape(K, G + 2, H, D)
    out = sharding.to_layout("wqkv", wqkv, cfg, 2)  # [4, 3, H, D]
    assert out.shape == (4, 3, H, D)
    np.testing.assert_array_equal(out[:, 0].reshape(K * G, H, D), wqkv[:, :G].reshape(K * G, H, D))
    for k in range(K):
        for j in range(2):
            np.testing.assert_array_equal(out[2 * k + j, 1:], wqkv[k, G:])
    wo = np.arange(D * K * G * H, dtype=np.float32).reshape(D, K, G, H)
    np.testing.assert_array_equal(sharding.to_layout("wo", wo, cfg, 2).reshape(D, -1), wo.reshape(D, -1))


def test_plan_errors():
    mesh = sharding.make_mesh(1)
    with pytest.raises(ValueError, match="devices"):
        sharding.make_mesh(len(jax.devices()) + 1)
    bad = jax.sharding.Mesh(jax.devices()[:1], ("model",))
    with pytest.raises(ValueError, match="'tp'"):
        sharding.plan(PRESETS["tiny"], bad)
    layout, tp = sharding.plan(PRESETS["mixtral-8x7b"], mesh, expert_parallel=True)
    assert tp.experts and not tp.expert_ffn and layout == PRESETS["mixtral-8x7b"]


def test_unsharded_step_has_no_collectives():
    """mesh=None keeps the one-device program: no shard_map, no psum, params.tp is None."""
    params = jaxllm.init_params(PRESETS["tiny"], jax.random.key(0), jnp.float32)
    assert params.tp is None
    cache = jaxllm.init_cache(params.config, 1, 16, jnp.float32)
    jaxpr = str(jax.make_jaxpr(step)(params, jnp.zeros((1, 1), jnp.int32), cache))
    assert "shard_map" not in jaxpr and "psum" not in jaxpr


@pytest.mark.slow
def test_one_device_mesh_equals_unsharded():
    """A tp=1 mesh runs the shard_map path with trivial collectives: the same logits."""
    params = jaxllm.init_params(PRESETS["tiny"], jax.random.key(0), jnp.float32, scale=0.3)
    sharded = sharding.shard_params(params, sharding.make_mesh(1))
    tokens = jnp.asarray([[5, 9, 200, 3]], jnp.int32)
    assert sharded.tp is not None
    assert jnp.allclose(jaxllm.forward(sharded, tokens), jaxllm.forward(params, tokens), atol=1e-6)
