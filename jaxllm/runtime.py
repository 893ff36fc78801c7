"""Device facts and XLA compiler options: what the running device is, the options the model's
programs compile with, and the warning where a kernel cannot run here (`fall_back`). Below every other module but env (imports: jax and env only)."""

import os
import threading
import warnings

import jax

# Where the device does not say (a CPU): an H100's or H200's count.
MULTIPROCESSORS = 132


def gpu_generation() -> int:
    """The default device's compute capability major (8 Ampere, 9 Hopper), 0 if not a GPU."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return 0
    return int(str(getattr(device, "compute_capability", "0")).split(".")[0] or 0)


def multiprocessors() -> int:
    """The default device's multiprocessor count, or MULTIPROCESSORS where it does not say."""
    return getattr(jax.devices()[0], "core_count", None) or MULTIPROCESSORS


class KernelFallbackWarning(UserWarning):
    """A kernel family a step would take cannot run here (its backend is missing or fails to
    import); its steps take XLA's form instead."""


_fallen_back: set[str] = set()
_fallen_back_lock = threading.Lock()


def fall_back(family: str, reason: str, instead: str = "takes XLA's form instead") -> None:
    """Say once a process, in one line, that kernel `family` takes XLA's form (or what `instead`
    says it does), and why."""
    with _fallen_back_lock:
        if family in _fallen_back:
            return
        _fallen_back.add(family)
    warnings.warn(f"jaxllm: the {family} kernel {instead}: {reason}",
                  KernelFallbackWarning, stacklevel=3)


def _unless_flagged(options: dict) -> dict:
    """`options` less those XLA_FLAGS names when jaxllm is imported (the user's choice wins)."""
    return {name: value for name, value in options.items() if name not in os.environ.get("XLA_FLAGS", "")}


# The fusion autotuner off and small redzones: cold compiles peaked far above the weights with it
# (docs/decisions/loop-and-compiler.md#the-fusion-autotuner-off). forward, step and generate's
# loop compile so.
AUTOTUNE_OPTIONS = _unless_flagged({
    "xla_gpu_experimental_enable_fusion_autotuner": False,
    "xla_gpu_redzone_padding_bytes": 1 << 16,
})
# WHILE and CONDITIONAL recorded too: the whole token loop is one CUDA graph and no step waits for
# the host (docs/decisions/loop-and-compiler.md#the-loop-as-one-cuda-graph). The profiler does not
# show a loop recorded so, so `generate` compiles the default way while a trace records.
LOOP_GRAPH_OPTIONS = {"xla_gpu_enable_command_buffer":
                      "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"}
# cuBLAS only, for a batch-1 generate of a dense float model (its products are all in the prefill):
# as fast, without compiling Triton GEMMs to autotune
# (docs/decisions/loop-and-compiler.md#cublas-only-for-batch-1-prefill-gemms).
ONE_ROW_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
