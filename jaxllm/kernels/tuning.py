"""The kernels' tuning knobs as one frozen `KernelTuning`, read from the JAXLLM_* environment once,
at import (`TUNING`). The step plan takes one and passes it to the kernels it picks; a kernel called
without one uses `current()`. Each value's reasons and figures are in docs/decisions/."""

import dataclasses

from jaxllm.env import env_choice, env_flag, env_ints, env_number

# "auto": a kernel on a GPU where the plan allows it, else XLA's form; "xla" never the kernel;
# "interpret" the kernel in Pallas' interpreter (tests on the CPU).
MODES = ("auto", "xla", "interpret")
# A family's kernel backend, where it has more than one: Pallas on Triton (deprecated in JAX 0.11)
# or Pallas on Mosaic GPU (docs/decisions/kernel-backends.md).
BACKENDS = ("triton", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Every knob of the Pallas kernels; hashable, so a jit static argument. Defaults are the
    measured choices; the environment overrides them for benchmarking."""
    # decode attention (docs/decisions/decode-attention.md)
    decode_attention: str = "auto"
    block_slots: int = 64  # cache slots a loop iteration
    split_slots: int = 128  # cache slots a program, longer caches split
    warps: int = 4
    one_split_values: int = 192  # B*K*H per multiprocessor from which one split
    fused_heads_values: int = 8192  # splits' values o's kernel combines itself
    pdl_trigger: bool = True  # each kernel lets the next launch early (Hopper)
    # steps of 2..verify_tokens new tokens a row on a warm cache (a speculative verify step):
    # the attention in `verify_attention`, the matrices in `rows_project` from verify_rows_min
    # rows (B*T); 0 tokens: XLA's prefill forms (docs/decisions/verify-step.md)
    verify_tokens: int = 9
    verify_rows_min: int = 2
    verify_tiles: tuple[int, ...] = (64, 128, 4)  # verify_attention's blocks, splits, warps
    # one-row projection (docs/decisions/one-row-projection.md)
    decode_project: str = "auto"
    kernel_max_weights: int = 8 * 2**20
    program_elements: int = 4096
    max_chunk: int = 2048
    project_warps: int = 4
    one_chunk_channels: int = 4096
    gate_up_wide: bool = True
    prefetch_max_bytes: int = 4 * 2**20
    prefetch_lines: bool = True
    weights_first: bool = True
    squares_last: bool = True
    project_backend: str = "triton"
    project_mosaic_stages: int = 4  # the Mosaic GPU form's weight blocks in flight
    # int8 (docs/decisions/int8.md)
    int8_convert: str = "permute"
    kernel_max_int8_weights: int = 128 * 2**20
    int8_tiles: tuple[int, ...] = (4, 4096, 4)  # rows of each operand, chunk, warps
    int8_norm_apart: bool = True
    int8_digits: bool = True
    int8_head_digits: bool = True
    int8_down_digits: bool = True
    digit_tiles: tuple[int, ...] = (64, 256, 4, 3)  # rows, chunk, warps, stages
    head_digit_tiles: tuple[int, ...] = (64, 256, 4, 3)
    down_digit_tiles: tuple[int, ...] = (32, 512, 4, 7)
    # 8-32-row decode steps (docs/decisions/rows-project.md)
    rows_project: str = "auto"
    rows_min: int = 8
    rows_max: int = 32
    rows_signal_rows: int = 32  # padded rows from which the kernel signals
    rows_any_size: int = 32  # rows from which any model's matrices take it
    rows_large_weights: int = 16 * 2**20  # below rows_any_size, each matrix's fewest weights
    rows_tiles: tuple[int, ...] = (0, 0, 4, 5)  # outputs, chunk, warps, stages; 0: per matrix
    # residual add + norm (docs/decisions/add-norm.md)
    add_norm: str = "auto"
    add_norm_trigger: bool = True
    add_norm_rows: int = 1
    add_norm_warps: int = 4
    add_norm_digit_warps: int = 16
    add_norm_backend: str = "triton"
    # MoE routing (docs/decisions/moe.md#routing-as-one-kernel)
    route: str = "auto"

    @classmethod
    def from_env(cls) -> "KernelTuning":
        """The defaults, overridden by the JAXLLM_* variables set (a bad value: ValueError)."""
        block, split, warps = env_ints("JAXLLM_DECODE_TILES", "64,128,4")
        elements, chunk, project_warps = env_ints("JAXLLM_PROJECT_TILES", "4096,2048,4")
        add_rows, add_warps = env_ints("JAXLLM_ADD_NORM_TILES", "1,4")
        return cls(
            decode_attention=env_choice("JAXLLM_DECODE_ATTENTION", MODES, "auto"),
            block_slots=block, split_slots=split, warps=warps,
            one_split_values=env_number("JAXLLM_DECODE_ONE_SPLIT", 192),
            fused_heads_values=env_number("JAXLLM_FUSED_HEADS", "8192"),
            pdl_trigger=env_flag("JAXLLM_PDL_TRIGGER", True),
            verify_tokens=env_number("JAXLLM_VERIFY_TOKENS", 9),
            verify_rows_min=env_number("JAXLLM_VERIFY_ROWS_MIN", 2),
            rows_large_weights=env_number("JAXLLM_ROWS_LARGE_WEIGHTS", 16 * 2**20),
            verify_tiles=env_ints("JAXLLM_VERIFY_TILES", "64,128,4"),
            decode_project=env_choice("JAXLLM_DECODE_PROJECT", MODES, "auto"),
            kernel_max_weights=env_number("JAXLLM_PROJECT_MAX_WEIGHTS", 8 * 2**20),
            program_elements=elements, max_chunk=chunk, project_warps=project_warps,
            one_chunk_channels=env_number("JAXLLM_PROJECT_ONE_CHUNK", 4096),
            gate_up_wide=env_flag("JAXLLM_GATE_UP_WIDE", True),
            prefetch_max_bytes=int(env_number("JAXLLM_PREFETCH_MAX_MB", "4", float) * 2**20),
            prefetch_lines=env_flag("JAXLLM_PREFETCH_LINES", True),
            weights_first=env_flag("JAXLLM_WEIGHTS_FIRST", True),
            squares_last=env_flag("JAXLLM_SQUARES_LAST", True),
            project_backend=env_choice("JAXLLM_PROJECT_BACKEND", BACKENDS, "triton"),
            project_mosaic_stages=env_number("JAXLLM_PROJECT_MOSAIC_STAGES", 4),
            int8_convert=env_choice("JAXLLM_INT8_CONVERT", ("permute", "i2f"), "permute"),
            kernel_max_int8_weights=env_number("JAXLLM_PROJECT_MAX_INT8_WEIGHTS", 128 * 2**20),
            int8_tiles=env_ints("JAXLLM_PROJECT_INT8_TILES", "4,4096,4"),
            int8_norm_apart=env_flag("JAXLLM_INT8_NORM_APART", True),
            int8_digits=env_flag("JAXLLM_INT8_DIGITS", True),
            int8_head_digits=env_flag("JAXLLM_INT8_HEAD_DIGITS", True),
            int8_down_digits=env_flag("JAXLLM_INT8_DOWN_DIGITS", True),
            digit_tiles=env_ints("JAXLLM_INT8_DIGIT_TILES", "64,256,4,3"),
            head_digit_tiles=env_ints("JAXLLM_INT8_HEAD_DIGIT_TILES", "64,256,4,3"),
            down_digit_tiles=env_ints("JAXLLM_INT8_DOWN_DIGIT_TILES", "32,512,4,7"),
            rows_project=env_choice("JAXLLM_ROWS_PROJECT", MODES, "auto"),
            rows_tiles=env_ints("JAXLLM_ROWS_TILES", "0,0,4,5"),
            add_norm=env_choice("JAXLLM_ADD_NORM", MODES, "auto"),
            add_norm_trigger=env_flag("JAXLLM_PDL_ADD_NORM", True),
            add_norm_rows=add_rows, add_norm_warps=add_warps,
            add_norm_digit_warps=env_number("JAXLLM_ADD_NORM_DIGIT_WARPS", "16"),
            add_norm_backend=env_choice("JAXLLM_ADD_NORM_BACKEND", BACKENDS, "triton"),
            route=env_choice("JAXLLM_ROUTE", MODES, "auto"))


TUNING = KernelTuning.from_env()


def current() -> KernelTuning:
    """The process's tuning (`TUNING`, which tests may replace)."""
    return TUNING
