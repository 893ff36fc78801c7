"""A kernel family whose backend is missing never breaks jaxllm: with the Pallas Triton backend
unavailable (deprecated in JAX 0.11, to be removed), `import jaxllm` works, the step plan takes
XLA's forms, `generate` gives the normal run's tokens, and each family says so once. Where it is
present, every kernel still lowers for a GPU with this JAX (checked on the CPU)."""

import ast
import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm import runtime
from jaxllm.kernels import common
from jaxllm.layers import moe
from jaxllm.tools.presets import PRESETS, random_params

SWITCHES = ("JAXLLM_DECODE_ATTENTION", "JAXLLM_DECODE_PROJECT", "JAXLLM_ADD_NORM",
            "JAXLLM_ROWS_PROJECT", "JAXLLM_ROUTE")
PROMPT = [[3, 17, 9, 41, 5, 77, 12]]
NEW = 12

# Run in a fresh interpreter whose imports of the Triton backend (its public module and JAX's
# internals behind it) fail, as after its removal; every kernel switch asks for the kernels.
_HIDDEN_RUN = """
import importlib.abc, json, sys, warnings
HIDDEN = ("jax.experimental.pallas.triton", "jax._src.pallas.triton", "jax._src.lib.triton")

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == h or name.startswith(h + ".") for h in HIDDEN):
            raise ImportError(f"{name} is hidden by the test")
        return None

sys.meta_path.insert(0, Hide())
warnings.simplefilter("always")  # every warning jaxllm raises is seen: once must be jaxllm's doing
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import jax.numpy as jnp
    import jaxllm, jaxllm.cli
    from jaxllm import runtime
    from jaxllm.kernels import common
    from jaxllm.tools.presets import PRESETS, random_params
    params = random_params(PRESETS["tiny"], 0, jnp.float32)
    runs = [jaxllm.generate(params, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).tokens.tolist()
            for _ in range(2)]
print(json.dumps(dict(missing=common.TRITON_MISSING, runs=runs,
                      hidden=sorted(m for m in sys.modules if any(m.startswith(h) for h in HIDDEN)),
                      warnings=[str(w.message) for w in caught
                                if issubclass(w.category, runtime.KernelFallbackWarning)])))
"""


@pytest.mark.slow
def test_generate_without_the_triton_backend_takes_xla_and_says_so_once():
    code = f"PROMPT, NEW = {PROMPT!r}, {NEW}\n" + _HIDDEN_RUN
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **dict.fromkeys(SWITCHES, "interpret")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["missing"] and "hidden by the test" in got["missing"]
    assert got["hidden"] == []  # nothing of the backend loaded by another route

    # The normal run (this process: the backend present, XLA's forms on the CPU for float32).
    params = random_params(PRESETS["tiny"], 0, jnp.float32)
    expected = jaxllm.generate(params, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).tokens.tolist()
    assert got["runs"] == [expected, expected]

    # One line a family the plan would have taken at one row (rows_project is for 8-32 rows),
    # naming the family and the reason, once in a process of two generate calls.
    families = ["add_norm", "decode_attention", "project", "route"]
    assert sorted(got["warnings"]) == sorted(
        f"jaxllm: the {f} kernel takes XLA's form instead: the Pallas Triton backend is unavailable "
        f"({got['missing']})" for f in families)
    assert all("\n" not in w for w in got["warnings"])


@pytest.fixture
def backend_missing(monkeypatch):
    """This process's kernels as if the Triton backend had failed to import, no family warned yet."""
    monkeypatch.setattr(common, "TRITON_MISSING", "ImportError: gone")
    monkeypatch.setattr(runtime, "_fallen_back", set())


def test_mode_without_backend_is_xla_with_one_warning_a_family(backend_missing):
    with pytest.warns(runtime.KernelFallbackWarning, match="decode_attention kernel .* unavailable .*gone"):
        assert common.mode("interpret", jnp.float32, "decode_attention") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning for the same family would raise here
        assert common.mode("interpret", jnp.bfloat16, "decode_attention") is None
    with pytest.warns(runtime.KernelFallbackWarning, match="the route kernel"):
        assert common.mode("interpret", jnp.float32, "route") is None


def test_mode_without_backend_is_silent_where_no_kernel_would_run(backend_missing, monkeypatch):
    """"xla", and "auto" off a GPU or for float32, never take a kernel: a missing backend changes
    nothing there."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert common.mode("xla", jnp.bfloat16, "project") is None
        monkeypatch.setattr(runtime, "gpu_generation", lambda: 9)
        assert common.mode("auto", jnp.float32, "project") is None
        monkeypatch.setattr(runtime, "gpu_generation", lambda: 0)
        assert common.mode("auto", jnp.bfloat16, "project") is None
    assert runtime._fallen_back == set()


def test_mosaic_gpu_backend_stands_without_triton_and_falls_back_without_itself(backend_missing, monkeypatch):
    """add_norm on Mosaic GPU (JAXLLM_ADD_NORM_BACKEND=mosaic_gpu) needs no Triton: on Hopper it
    runs with Triton gone, a call it cannot take then takes XLA's form; with Mosaic GPU gone it
    falls back to XLA with one warning naming that backend; below Hopper it says it needs Hopper."""
    from tests.kernel_modes import spy
    monkeypatch.setattr(runtime, "gpu_generation", lambda: 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert common.mode("auto", jnp.bfloat16, "add_norm", "mosaic_gpu") == "gpu"
        from jaxllm import kernels
        mosaic = spy(monkeypatch, "_mosaic_add_norm_call")
        x, g = jnp.arange(80, dtype=jnp.float32).reshape(1, 80) / 80, jnp.ones((80,))
        tuning = dataclasses.replace(kernels.current(), add_norm_backend="mosaic_gpu")
        got = kernels.add_norm(x, x, g, 1e-5, mode="gpu", tuning=tuning)  # 80 wide: not rows of 64
        want = kernels.add_norm(x, x, g, 1e-5)
        assert mosaic == [] and all(np.array_equal(a, b) for a, b in zip(got, want))
    monkeypatch.setattr(runtime, "gpu_generation", lambda: 8)
    with pytest.warns(runtime.KernelFallbackWarning, match="project kernel .*needs a Hopper GPU"):
        assert common.mode("auto", jnp.bfloat16, "project", "mosaic_gpu") is None
    monkeypatch.setattr(runtime, "gpu_generation", lambda: 9)
    monkeypatch.setattr(common, "MOSAIC_MISSING", "ImportError: also gone")
    with pytest.warns(runtime.KernelFallbackWarning, match="add_norm kernel .*Mosaic GPU backend is unavailable .*also gone"):
        assert common.mode("auto", jnp.bfloat16, "add_norm", "mosaic_gpu") is None


def test_mode_with_backend_is_unchanged(monkeypatch):
    assert common.TRITON_MISSING is None  # this environment has the backend
    assert common.mode("interpret", jnp.float32, "project") == "interpret"
    assert common.mode("xla", jnp.bfloat16, "project") is None
    monkeypatch.setattr(runtime, "gpu_generation", lambda: 9)
    assert common.mode("auto", jnp.bfloat16, "project") == "gpu"


def test_grouped_gemm_without_its_module_is_xla_with_one_warning(monkeypatch):
    """The MoE grouped GEMM (Pallas on Mosaic GPU, Hopper only) whose module fails to import:
    the experts take XLA's ragged_dot, after one warning."""
    monkeypatch.setattr(runtime, "_fallen_back", set())
    monkeypatch.setattr(moe, "gpu_generation", lambda: 9)
    x_RK, w_ENK = jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((4, 128, 128), jnp.bfloat16)
    moe._mgpu_ragged_dot.cache_clear()
    try:
        assert moe._mgpu_ok(x_RK, w_ENK)  # present: taken (a CPU imports the module too)
        moe._mgpu_ragged_dot.cache_clear()
        # gone from sys.modules and from its package (`from package import module` looks there first)
        monkeypatch.setitem(sys.modules, "jax.experimental.pallas.ops.gpu.ragged_dot_mgpu", None)
        monkeypatch.delattr(sys.modules["jax.experimental.pallas.ops.gpu"], "ragged_dot_mgpu")
        with pytest.warns(runtime.KernelFallbackWarning, match="grouped_gemm kernel .* unavailable"):
            assert not moe._mgpu_ok(x_RK, w_ENK)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not moe._mgpu_ok(x_RK, w_ENK)
    finally:
        moe._mgpu_ragged_dot.cache_clear()


PACKAGE = Path(jaxllm.__file__).resolve().parent

def _internal_uses(path: Path) -> set[str]:
    """What of jax._src `path` imports (`from m import x` as m.x, inside functions too) or
    reaches as an attribute jax._src.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names]  # a module or a name in one
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "jax._src":
            names = [ast.unparse(node)]
        else:
            continue
        found |= {n for n in names if n == "jax._src" or n.startswith("jax._src.")}
    return found


def test_the_package_uses_no_jax_internals(tmp_path):
    """No module of the package imports or reaches `jax._src` (issue 62): JAX's internals change
    without notice, and a JAX whose internals moved must still import and run jaxllm."""
    used = {(str(p.relative_to(PACKAGE)), m) for p in sorted(PACKAGE.rglob("*.py")) for m in _internal_uses(p)}
    assert used == set(), f"uses of jax._src: {sorted(used)}"
    # the walk sees what it looks for: a use written each of three ways, inside a function too
    written = tmp_path / "uses.py"
    written.write_text("from jax._src import core\nimport jax._src.pallas\ndef f():\n    return jax._src.config\n")
    assert _internal_uses(written) == {"jax._src.core", "jax._src.pallas", "jax._src.config"}


def test_a_kernel_that_fails_to_compile_takes_xla_with_one_warning(monkeypatch):
    """The backend imports but one family's kernel fails to lower (as under a JAX release it was
    not written for): the plan takes XLA's form for that family alone, says so once, and
    `generate` gives the tokens of XLA's run; the other families still take their kernels."""
    from jaxllm.kernels import probe
    from jaxllm.model.plan import describe, step_plan
    from tests.kernel_modes import tune

    monkeypatch.setattr(runtime, "_fallen_back", set())
    monkeypatch.setattr(probe, "_results", {})
    params = random_params(PRESETS["tiny"], 0, jnp.float32)
    tune(monkeypatch, decode_attention="xla", decode_project="xla", add_norm="xla")
    expected = jaxllm.generate(params, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).tokens.tolist()

    def broken(*args, **kwargs):
        raise NotImplementedError("no lowering rule for a primitive of this kernel")
    monkeypatch.setattr(sys.modules["jaxllm.kernels.decode_attention"], "_decode_attention_kernel", broken)
    tune(monkeypatch, decode_attention="interpret", decode_project="interpret", add_norm="interpret")
    with pytest.warns(runtime.KernelFallbackWarning) as caught:
        runs = [jaxllm.generate(params, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).tokens.tolist()
                for _ in range(2)]
    assert runs == [expected, expected]
    assert [str(w.message) for w in caught] == [
        "jaxllm: the decode_attention kernel takes XLA's form instead: its kernel does not compile "
        "here (NotImplementedError: no lowering rule for a primitive of this kernel)"]
    # bench's report of a decode step's paths: the other kernels stay
    paths = describe(step_plan(params, 1, 1, cache_length=128))
    assert paths["attention"] == "xla" and paths["qkv"] == paths["lm_head"] == "project"


def test_every_kernel_lowers_for_a_hopper_gpu_with_this_jax(monkeypatch):
    """CI runs the newest JAX the index serves, on CPUs, where the kernels otherwise run only in
    Pallas' interpreter. JAX lowers a program for a platform it has no device for, so here each
    kernel family is lowered for CUDA as a Hopper GPU's step plan asks for it (the probe's shapes:
    a Pallas Triton custom call each) and so is the MoE's Mosaic GPU grouped GEMM: a JAX release
    that breaks a kernel's lowering fails here, before a GPU user meets its fallback."""
    import jax
    from jaxllm.kernels import probe
    from jaxllm.kernels.tuning import current
    from tests.kernel_modes import calls_triton

    assert common.TRITON_MISSING is None, (
        f"this JAX has no Pallas Triton backend ({common.TRITON_MISSING}): every GPU kernel falls back")
    monkeypatch.setattr(runtime, "gpu_generation", lambda: 9)
    monkeypatch.setattr(moe, "gpu_generation", lambda: 9)
    lowered = {}

    def lower_for_cuda(family):
        def lower(fn, *specs):
            lowered[family] = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
        return lower
    for family, probe_family in probe.PROBES.items():
        monkeypatch.setattr(probe, "_compile", lower_for_cuda(family))
        probe_family("gpu", current())
    assert sorted(lowered) == sorted(probe.PROBES)
    assert [f for f, text in lowered.items() if not calls_triton(text)] == []
    for family in ("add_norm", "project"):  # the families with a Mosaic GPU form, under that backend
        monkeypatch.setattr(probe, "_compile", lower_for_cuda(f"{family} on Mosaic GPU"))
        probe.PROBES[family]("gpu", dataclasses.replace(current(), **{f"{family}_backend": "mosaic_gpu"}))
        assert "mosaic_gpu" in lowered[f"{family} on Mosaic GPU"], family
    x, w = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16), jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16)
    grouped = jax.jit(moe._grouped_matmul).trace(x, w, jax.ShapeDtypeStruct((4,), jnp.int32))
    assert "mosaic_gpu" in grouped.lower(lowering_platforms=("cuda",)).as_text()
