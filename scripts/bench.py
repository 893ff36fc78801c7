#!/usr/bin/env python
"""Benchmark `jaxllm.generate` on one device: one JSON line per run on stdout, the rest on stderr.

    python scripts/bench.py --preset llama3-8b --batch 1,8,32 --prompt-len 128 --new-tokens 256
    python scripts/bench.py --preset llama3-8b --context 512,8192       # decode cost vs context
    python scripts/bench.py --preset llama3-8b --batch 32 --measure-floor  # vs its reads as one array
    python scripts/bench.py --preset llama3-8b --verify 4,5,8   # verify steps vs a one-token step
    python scripts/bench.py --model path/to/hf_dir --measure-peaks --plot bench.png
    python scripts/bench.py --preset llama3-8b --write-checkpoint /tmp/ck   # random, HF layout
    python scripts/bench.py --model /tmp/ck --cold --load-only              # load against disk
    python scripts/bench.py --model /tmp/ck --fresh --load-only   # as a fresh machine's first process
    python scripts/bench.py --model M.gguf --speculate ngram --prompt-set code,summary,chat --prompt-len 1024
    python scripts/bench.py --preset llama3-8b --speculate ngram --batch 1,4,8,32   # where it stops paying

A run is one (batch, prompt length): random prompts, greedy, no stop ids, so every row makes all
--new-tokens. The first `generate` call includes compilation; --repeat timed calls follow. Prefill
is timed on its own through `init_cache` + `prefill` on the same prompt shape and cache length, the
first sample through `sample`; a decode step is (generate - prefill - first sample) / (new - 1).
Bytes and FLOPs come from `jaxllm.tools.roofline` (the fewest a step must move), the decode ones at the
mean context of the decode steps (prompt + new/2), the prefill ones for the real prompt tokens
(not the left padding up to the bucket). Achieved TB/s is those bytes over the measured step. Beside each JSON line, stderr gets the decode
roofline table and the measured step against it.

JSON keys (times in the unit their name says; null when not available on this device):
  preset, model, device, platform, jax_version, jaxlib_version, git, source, tp, env, compile_cache,
  dtype, quant, kv_dtype, batch, prompt_len, padded_prompt_len, new_tokens, cache_len, repeat,
  param_count, param_bytes, kv_cache_bytes,
  first_call_s, compile_s, generate_s, generate_s_all,
  prefill_ms, prefill_flops, prefill_tflops, prefill_roofline_ms, prefill_pct_matmul_peak,
  sample_ms, ttft_ms,
  decode_ms_per_step, decode_tokens_per_s_per_seq, decode_tokens_per_s, end_to_end_tokens_per_s,
  decode_context_mean, weight_bytes_per_step, kv_bytes_per_step, bytes_per_step,
  achieved_tbps, peak_tbps, pct_peak_bw, copy_tbps, pct_copy_bw, matmul_tflops,
  copy_tbps_burst, matmul_tflops_burst, power_limit_w,
  copy_sm_mhz, copy_sm_mhz_min, copy_power_w, copy_power_capped_pct,
  matmul_sm_mhz, matmul_sm_mhz_min, matmul_power_w, matmul_power_capped_pct,
  prefill_sm_mhz, prefill_sm_mhz_min, prefill_power_w, prefill_power_capped_pct,
  decode_sm_mhz, decode_sm_mhz_min, decode_power_w, decode_power_capped_pct,
  decode_roofline_ms, pct_of_roofline, roofline_tokens_per_s,
  floor_ms, floor_tokens_per_s, floor_sm_mhz, pct_of_floor,
  activation_bytes, peak_bytes_in_use, bytes_in_use, bytes_limit, peak_pct_of_need, decode_paths, error
peak_bytes_in_use is the process's peak so far (JAX cannot reset it; runs are in the order given),
read after the timed generate calls, before the prefill is timed on its own. It includes what
compiling took: XLA's autotuner, when no compilation cache has the program, held 72-258 MB more
than generate's run (SmolLM2, Qwen3-0.6B), 0-49 MB since `runtime.AUTOTUNE_OPTIONS` (the most for
Llama-3.2-1B). activation_bytes is `memory.check_fit`'s bound on one step's activations (the
prefill's, the largest), peak_pct_of_need the peak against weights + KV cache + that bound on one
device.
decode_paths says which path a decode step's parts take: {"qkv", "attention", "o", "add_norm",
"gate_up", "down", "lm_head"(, "route")} -> "project" (one-row kernel), "rows" (rows kernel),
"kernel" or "xla", and "mosaic_gpu" -> the families JAXLLM_*_BACKEND=mosaic_gpu put on Mosaic GPU
(jaxllm.model.plan.describe), so a run on a machine without a kernel backend,
a kernel whose compile probe failed, or a model feature no kernel has, says so in its line.
With --model, each line (and the one line of --load-only, which names dtype and quant as well)
also has load_s, checkpoint_bytes, load_gb_per_s (the files' bytes over load_s), cold and fresh;
with --cold (or --fresh), disk_read_gb_per_s (one plain sequential read of the same files,
dropped from the page cache before it and again after), and disk_gb_read_in_plain_read and
disk_gb_read_in_load: what the machine's disks read (Linux's /sys/block counts, null elsewhere)
during that read and during the load, the load's including whatever else the process read from
them meanwhile (a first GPU process's libraries, which --fresh drops from the page cache too).
With --tp N, the peaks (datasheet, measured copy and matmul rates) are N devices' together, so the
roofline is N devices each reading its shard at once (all-reduces not counted), and the memory
figures are those of the device using the most.
The GPU runs at its power limit in long enough work (on an H200 the 8B shape's prefill and decode,
and a matmul past its first 75 ms: see jaxllm.tools.telemetry). So the probes' copy_tbps and
matmul_tflops are rates after SUSTAIN_S of the same work, the prefill is timed after SUSTAIN_S of
prefills, and the *_burst rates are each probe's first 10 x 5 calls. PHASE_sm_mhz (median),
PHASE_sm_mhz_min, PHASE_power_w (median) and PHASE_power_capped_pct (share of NVML readings with
the clocks held down by a power cap, thermal or hardware slowdown) are read every 20 ms while the
phase was timed: copy and matmul (the probes, with --measure-peaks, on one device), prefill,
decode (the timed generate calls). With --tp N the prefill's and decode's are the N devices' in
step: each reading the lowest clock among them, the highest power, and held down where any one
was (jaxllm.tools.telemetry.slowest). Null without NVML (a CPU, or no nvidia-ml-py).
With --measure-floor, a child process first times each run's decode reads (the roofline's weight
and KV bytes at the mean context) as XLA reads bytes fastest: random bf16 of the same size, one
array, one row reduction a step, in a jitted loop compiled as generate's (one CUDA graph), timed
after SUSTAIN_S as the peaks are. floor_ms is that time: no read of those bytes measured on an
H200 ran faster (copies, other kernels), so it is the floor of any step that reads them, at the
clock it ran at (floor_sm_mhz); floor_tokens_per_s the rate it would give; pct_of_floor the
measured step against it. A step of many kernels adds their boundaries to it. Null without the flag.
source is a hash of jaxllm's and this script's sources: it names the code where git cannot.
With --speculate, --draft-model or --draft-preset each run first times plain generate on the same
prompts (the baseline of the same run), then the speculative calls, which the timing keys above
describe; the line also has speculate, num_speculative (null: adaptive), synthetic_acceptance,
verify_cost (the tuning adaptive k pauses by), spec_default_on (whether generate's default would
speculate at this batch: bench speculates at every batch, the default only up to
SpecTuning.batch_limit rows: 4 with prompt lookup, 64 with a draft model), plain_generate_s,
plain_tokens, plain_tokens_per_s, spec_tokens, spec_tokens_per_s, speedup (spec_tokens_per_s over
plain_tokens_per_s), rows_same_as_plain (the share of rows whose answer is plain generate's, token
for token: greedy speculation makes the same tokens but for rounding, the verify step's sums being
in another order), spec_roofline_tokens_per_s (a round's floor: one target step's roofline and
k draft steps' weights at the datasheet bandwidth, over the tokens a round made) and
pct_of_spec_roofline (decode_tokens_per_s against it), and spec (the SpecStats:
k, rounds, verify_rounds, row_rounds, drafted, accepted, histogram, tokens, off_at_batch,
acceptance_rate, tokens_per_step). With --prompt-set (real prompts, rows stopping at the model's
end of turn) the line has prompt_set, and without speculation tokens (the tokens made); a decode
step is then the time over the longest row's tokens, and end_to_end_tokens_per_s counts the tokens
made.

With --verify T,..., each (batch, prompt length) instead times one-token steps and steps of T new
tokens a row with every position's logits (a speculative verify step, `step(..., all_logits=True)`)
on a cache warm at the prompt length: VERIFY_STEPS steps in one jitted loop compiled as a
speculative generate's, each step's greedy tokens fed to the next and its slots rolled back, so
every step sees the same context. One JSON line per T (1 first): the label's keys, batch,
prompt_len, cache_len, tokens_per_row, steps, repeat, step_ms (median of --repeat loops),
step_ms_all, ms_per_token (step_ms / T), vs_one_token (step_ms over the one-token step's),
attention and projection (the step plan's kernel families: null is XLA's).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from functools import partial
from pathlib import Path

DATASHEET_BW = 4.8e12  # H200 HBM3e, vendor datasheet (bytes/s)
COPY_PROBE_BYTES = 4 << 30  # ~4.3 GB: 70x the H200's L2, so the copy streams HBM
MATMUL_PROBE_N = 8192
VERIFY_STEPS = 64  # steps in --verify's timed loop: its launch and the host's wait amortized
# Work that runs this long is past the power cap's onset: on an H200 an 8192-cube matmul timed in
# its first 75 ms ran 763 TFLOP/s at 1980 MHz, timed over 0.8 s 702 at 1530 MHz (power-capped).
# The probes and the prefill are timed after this much of the same work; generate's calls of a
# large model last longer themselves.
SUSTAIN_S = 0.5
# The floor probe's loop: steps a call (so that a call of a small model outlasts its launch), and
# the row its reduction sums (whole rows of random bf16, the bytes rounded up to them).
FLOOR_STEPS = 16
FLOOR_ROW = 1024
CLOCK_KEYS = ("sm_mhz", "sm_mhz_min", "power_w", "power_capped_pct")  # of telemetry's summary




def _load_checks():
    """jaxllm/checks.py alone: importing the package would set up its compile cache before
    --no-compile-cache is read (main imports jaxllm after that)."""
    spec = importlib.util.spec_from_file_location(
        "_jaxllm_checks", Path(__file__).resolve().parent.parent / "jaxllm" / "checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checks = _load_checks()
argtype = checks.argtype
MAX_SIZE = checks.INT32_MAX  # the largest batch or prompt taken: int32, as the arrays that index them
MAX_SEED = 2**63 - 1  # jax.random.key takes a C long


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
    if not values or min(values) < 1 or max(values) > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 and <= {MAX_SIZE}, got {text!r}")
    return values


# Prompts for speculative decoding on a real model (--prompt-set): input-grounded ones, whose
# answer repeats much of the prompt (prompt lookup's case), and open chat, whose answer does not.
PROMPT_SETS = {
    "code": "Rewrite this Python code with type hints added, keeping everything else the same:\n\n"
            "```python\n{text}\n```",
    "summary": "Summarize this passage from the Python reference, quoting its key sentences:\n\n{text}",
    "chat": "{text}",
}
_CODE_MODULES = ("textwrap", "shlex", "fnmatch", "bisect", "heapq", "colorsys", "glob", "sched")
_PASSAGES = ("exceptions", "execmodel", "naming", "import", "for", "try", "class", "function")
_QUESTIONS = ("Write a short story about a lighthouse keeper who befriends a seagull.",
              "What are some good habits for staying healthy while working from home?",
              "Explain how a rainbow forms, as if to a ten-year-old.",
              "Plan a three-day trip to a city you like and say why.",
              "What makes a good friend? Give a few examples.",
              "Describe your ideal breakfast and how to make it.",
              "Why do people enjoy music? Give several reasons.",
              "Tell me about the history of bicycles.")


def _name_list(names):
    """An argparse type: a comma list of names among `names`."""
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values or any(v not in names for v in values):
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(names)}, got {text!r}")
        return values
    return parse


def prompt_set(name: str, tokenizer, rows: int, budget: int) -> list[list[int]]:
    """`rows` prompts of set `name` through the tokenizer's chat template, row b from the b-th
    source (cycled): a standard-library module's code, a passage of the Python reference, or an
    open question; a source is cut at a line so that the whole prompt has at most `budget` tokens."""
    out = []
    for b in range(rows):
        if name == "code":
            import importlib
            text = Path(importlib.import_module(_CODE_MODULES[b % len(_CODE_MODULES)]).__file__).read_text()
        elif name == "summary":
            from pydoc_data.topics import topics
            text = topics[_PASSAGES[b % len(_PASSAGES)]]
        else:
            text = _QUESTIONS[b % len(_QUESTIONS)]
        lines = text.splitlines()
        low, high = 0, len(lines)  # the most lines that fit: a binary search over the cut
        while low < high:
            mid = (low + high + 1) // 2
            ids = _chat_ids(tokenizer, PROMPT_SETS[name].format(text="\n".join(lines[:mid])))
            low, high = (mid, high) if len(ids) <= budget else (low, mid - 1)
        ids = _chat_ids(tokenizer, PROMPT_SETS[name].format(text="\n".join(lines[:low])))
        if len(ids) > budget:
            raise ValueError(f"--prompt-len {budget} holds no prompt of set {name!r} ({len(ids)} tokens at least)")
        out.append(ids)
    return out


def _chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _rate_arg(text: str) -> float:
    """An argparse type: a positive, finite rate."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive, finite rate, got {text}")
    return value


def _unwritable(path: Path, what: str) -> str | None:
    """Why a file or directory cannot be made at `path` (its nearest existing ancestor must be a
    writable directory), else None."""
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{what} {path}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{what} {path}: {parent} is not writable"
    return None


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="a model shape with random weights (jaxllm.tools.presets.PRESETS)")
    src.add_argument("--model", help="a checkpoint to load: HF directory or .gguf file")
    p.add_argument("--batch", type=_int_list, default=[1], help="rows, or a comma list: 1,8,32")
    p.add_argument("--prompt-len", "--context", dest="prompt_len", type=_int_list, default=[128],
                   help="prompt tokens per row, or a comma list; decode then runs at this context")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per row (>= 2)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--quant", default="none", choices=("none", "int8"), help="weight quantization")
    p.add_argument("--kv-dtype", default=None, choices=("bf16", "int8"),
                   help="KV cache dtype (default: the model dtype)")
    p.add_argument("--tp", type=argtype(1, 1 << 20), default=1,
                   help="tensor-parallel over this many devices (random weights drawn into their shards); "
                        "the roofline columns stay those of the whole model on one device")
    p.add_argument("--expert-parallel", action="store_true",
                   help="with --tp on a mixture of experts: split the experts over the devices instead "
                        "of each expert's F")
    p.add_argument("--repeat", type=int, default=3, help="timed generate calls per run (median)")
    p.add_argument("--seed", type=argtype(0, MAX_SEED), default=0)
    p.add_argument("--trace-dir", help="record one profiled generate call per run under this directory")
    p.add_argument("--plot", help="PNG: decode tokens/s against batch beside the roofline (matplotlib)")
    p.add_argument("--measure-peaks", action="store_true",
                   help="first measure copy bandwidth and bf16 matmul rate, sustained and in a first "
                        "burst, with their clocks (in a child process)")
    p.add_argument("--measure-floor", action="store_true",
                   help="first time each run's decode reads (weights, KV cache) as one array read "
                        "by one XLA reduction: the step's floor (in a child process)")
    p.add_argument("--copy-tbps", type=_rate_arg, help="measured copy bandwidth to compare with (TB/s)")
    p.add_argument("--matmul-tflops", type=_rate_arg, help="measured bf16 matmul rate to compare with")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="turn off jaxllm's persistent compilation cache (cold compile times)")
    p.add_argument("--write-checkpoint", metavar="DIR",
                   help="write the --preset's shape with random weights as a Hugging Face "
                        "checkpoint in DIR (one JSON line), then exit: --model DIR loads it")
    p.add_argument("--cold", action="store_true",
                   help="with --model DIR: drop its files from the page cache, time one plain read "
                        "of them (the disk's rate), drop them again, then load")
    p.add_argument("--fresh", action="store_true",
                   help="--cold, and the GPU backend's libraries (JAX's CUDA plugin, the nvidia "
                        "packages) dropped from the page cache too before the load, as a fresh "
                        "machine's first process finds them: read from the disk as it loads")
    p.add_argument("--load-only", action="store_true",
                   help="with --model: print the load's JSON line and stop")
    spec = p.add_argument_group("speculative decoding (each run also times plain generate, the baseline)")
    spec.add_argument("--speculate", choices=("ngram",), help="prompt lookup proposes the drafts")
    spec.add_argument("--draft-model", metavar="PATH", help="a draft checkpoint (same tokenizer)")
    spec.add_argument("--draft-preset", metavar="NAME", help="a draft of this preset's shape, random weights")
    spec.add_argument("--draft-quant", choices=("none", "int8"), default=None,
                      help="the draft's weight quantization (default: --quant's); the target's "
                           "tokens do not depend on it, only how many drafts it accepts")
    spec.add_argument("--num-speculative", type=argtype(1, 32), default=None, metavar="K",
                      help="drafts a round (default: adaptive, 7 for ngram, 3 for a draft)")
    spec.add_argument("--synthetic-acceptance", type=float, default=None, metavar="A",
                      help="accept each draft with probability A in [0, 1], whatever the models say "
                           "(random weights accept nothing meaningful; the tokens are then meaningless)")
    spec.add_argument("--prompt-file", metavar="FILE",
                      help="with --model: every row's prompt is this text through the model's tokenizer "
                           "(input-grounded prompts for --speculate ngram); --prompt-len is then ignored")
    p.add_argument("--verify", type=_int_list, metavar="T,...",
                   help="time one-token steps and steps of T tokens a row with every position's logits "
                        "(speculative verify steps) on a warm cache, instead of generate")
    spec.add_argument("--prompt-set", type=_name_list(PROMPT_SETS), metavar="NAMES",
                      help="with --model: real prompts through the model's chat template, built from "
                           "Python's standard library, a comma list of " + ", ".join(PROMPT_SETS) +
                           " (each row its own source, the whole prompt at most --prompt-len tokens); "
                           "rows stop at the model's end of turn")
    p.add_argument("--peaks-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--floor-probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peaks_probe or args.floor_probe:
        return args
    if not (args.preset or args.model):
        p.error("give --preset NAME or --model PATH")
    if args.write_checkpoint and not args.preset:
        p.error("--write-checkpoint takes the shape of --preset")
    if (args.cold or args.fresh or args.load_only) and not args.model:
        p.error("--cold, --fresh and --load-only time the loading of --model")
    args.cold = args.cold or args.fresh
    if args.verify and (args.tp > 1 or args.draft_model or args.draft_preset or args.speculate
                        or args.measure_floor or args.load_only or args.write_checkpoint or args.prompt_file):
        p.error("--verify times steps on one device: it takes none of --tp, --speculate, --draft-model, "
                "--draft-preset, --measure-floor, --load-only, --write-checkpoint, --prompt-file")
    if args.verify and max(args.verify) > 64:
        p.error("--verify: at most 64 tokens a row")
    if args.measure_floor and args.tp > 1:
        p.error("--measure-floor times one device's reads; it does not take --tp")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2: a decode step is timed from the tokens after the first")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    # Paths, checked before any run: a bad one found after minutes of timing loses them.
    if args.model is not None:
        model = Path(args.model)
        if not args.model.strip() or not model.exists():
            p.error(f"--model: no model at {args.model!r}")
    if args.write_checkpoint is not None:
        out = Path(args.write_checkpoint)
        if not args.write_checkpoint.strip():
            p.error("--write-checkpoint: empty path")
        if out.exists() and not out.is_dir():
            p.error(f"--write-checkpoint: {out} exists and is not a directory")
        if out.is_dir() and any(out.iterdir()):
            p.error(f"--write-checkpoint: {out} exists and is not empty")
        if not out.exists() and (why := _unwritable(out, "--write-checkpoint")):
            p.error(why)
    if args.trace_dir is not None:
        out = Path(args.trace_dir)
        if not args.trace_dir.strip():
            p.error("--trace-dir: empty path")
        if out.exists() and not out.is_dir():
            p.error(f"--trace-dir: {out} exists and is not a directory")
        if why := _unwritable(out / "x", "--trace-dir"):
            p.error(why)
    if args.plot is not None:
        out = Path(args.plot)
        if not args.plot.strip() or out.is_dir():
            p.error(f"--plot: {args.plot!r} is not a file name")
        if why := _unwritable(out, "--plot"):
            p.error(why)
        if not out.absolute().parent.is_dir():
            p.error(f"--plot {out}: no directory {out.absolute().parent}")
        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    drafts = [x for x in (args.speculate, args.draft_model, args.draft_preset) if x]
    if len(drafts) > 1:
        p.error("give one of --speculate, --draft-model, --draft-preset")
    if (args.num_speculative is not None or args.synthetic_acceptance is not None) and not drafts:
        p.error("--num-speculative and --synthetic-acceptance need --speculate, --draft-model or --draft-preset")
    if args.draft_quant is not None and not (args.draft_model or args.draft_preset):
        p.error("--draft-quant needs --draft-model or --draft-preset")
    if args.synthetic_acceptance is not None and not 0 <= args.synthetic_acceptance <= 1:
        p.error(f"--synthetic-acceptance must be in [0, 1], got {args.synthetic_acceptance}")
    if args.draft_model is not None and not Path(args.draft_model).exists():
        p.error(f"--draft-model: no model at {args.draft_model!r}")
    if args.prompt_file is not None and (not args.model or not Path(args.prompt_file).is_file()):
        p.error("--prompt-file takes a text file, with --model (its tokenizer)")
    if args.prompt_set and (not args.model or args.prompt_file):
        p.error("--prompt-set takes --model (its tokenizer and chat template), not --prompt-file")
    # Refuse what the library cannot do yet rather than benchmark something else under its name.
    if args.kv_dtype == "bf16" and args.dtype != "bfloat16":
        p.error(f"--kv-dtype bf16 with --dtype {args.dtype} is not implemented yet in jaxllm "
                "(the KV cache follows the model dtype)")
    return args


def _usage_error(message: str) -> int:
    """Bad input found after the flags were parsed: one line on stderr, as argparse's, exit 2."""
    print(f"bench.py: error: {message}", file=sys.stderr, flush=True)
    return 2


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Timing


def _wait(x):
    import jax
    return jax.block_until_ready(x)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    _wait(fn())
    return time.perf_counter() - t0


def _median_time(fn, repeat: int) -> tuple[float, list[float]]:
    times = [_timed(fn) for _ in range(repeat)]
    return statistics.median(times), times


def _rate(fn, calls: int = 10, rounds: int = 5) -> float:
    """Median seconds per call of `calls` back-to-back launches (one wait), after a warm-up."""
    _wait(fn())
    _wait(fn())
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()  # the stream runs in order: the last result ready means all are done
        _wait(out)
        per_call.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_call)


def _sustained(fn, burst_s: float):
    """(`_rate` of fn after it has run for SUSTAIN_S, its clocks meanwhile): the rate a phase that
    lasts longer than a burst gets under the GPU's power cap (see jaxllm.tools.telemetry)."""
    from jaxllm.tools import telemetry
    calls = max(1, round(SUSTAIN_S / 5 / burst_s))
    _rate(fn, calls, rounds=5)
    with telemetry.sample() as clock:
        seconds = _rate(fn, calls, rounds=5)
    return seconds, clock


def _clock_fields(phase: str, clock) -> dict:
    """A phase's clocks for the JSON line, as `telemetry.Sampler.summary` gives them."""
    c = clock.summary()
    return {f"{phase}_{k}": c[k] for k in CLOCK_KEYS}


def measure_peaks() -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, on random data, never zeros:
    sustained (after SUSTAIN_S of the same work, as the timed phases run) and in a first burst."""
    import jax
    import jax.numpy as jnp
    key = jax.random.key(1)
    x = jax.random.normal(key, (COPY_PROBE_BYTES // 4,), jnp.float32)
    scale = jax.jit(lambda x: x * 1.5)
    copy_burst_s = _rate(lambda: scale(x))
    copy_s, copy_clock = _sustained(lambda: scale(x), copy_burst_s)
    del x
    n = MATMUL_PROBE_N
    a = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 2), (n, n), jnp.bfloat16)
    matmul = jax.jit(jnp.matmul)
    mm_burst_s = _rate(lambda: matmul(a, b))
    mm_s, mm_clock = _sustained(lambda: matmul(a, b), mm_burst_s)
    return dict(copy_tbps=2 * COPY_PROBE_BYTES / copy_s / 1e12,
                copy_tbps_burst=2 * COPY_PROBE_BYTES / copy_burst_s / 1e12,
                matmul_tflops=2 * n ** 3 / mm_s / 1e12, matmul_tflops_burst=2 * n ** 3 / mm_burst_s / 1e12,
                **_clock_fields("copy", copy_clock), **_clock_fields("matmul", mm_clock),
                power_limit_w=mm_clock.power_limit_w, device=jax.devices()[0].device_kind)


def _child_probe(flag: str, fallback: str, stdin: str | None = None) -> dict | None:
    """This script run again with a probe's `flag`, before this process touches the device, so
    that the probe's buffers never share its memory: the JSON of its last line, or None, logged
    with what the results do without it (`fallback`)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), flag], env=env, input=stdin,
                          stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        log(f"bench: the {flag[2:].replace('-', ' ')} failed (exit {proc.returncode}); {fallback}")
        return None
    return json.loads(lines[-1])


def probe_peaks() -> dict:
    """measure_peaks in a child process (`_child_probe`)."""
    peaks = _child_probe("--peaks-probe", "comparing with the datasheet only")
    if peaks is None:
        return {}
    log(f"bench: measured on {peaks['device']}: copy {peaks['copy_tbps']:.2f} TB/s "
        f"({peaks['copy_tbps_burst']:.2f} in a first burst), bf16 matmul {peaks['matmul_tflops']:.0f} "
        f"TFLOP/s ({peaks['matmul_tflops_burst']:.0f}), at {peaks['matmul_sm_mhz'] or '?'} MHz")
    return peaks


def measure_floor(nbytes: int) -> dict:
    """Milliseconds to read `nbytes` of random bf16 as one array, one row reduction a step (each
    step's reduction scaled by the last one's result, so that the steps run in turn), in a jitted
    loop of FLOOR_STEPS steps compiled as generate's token loop, timed as `_sustained` times the
    peaks; and the clock meanwhile."""
    import jax
    import jax.numpy as jnp

    from jaxllm.runtime import LOOP_GRAPH_OPTIONS

    def read(w):
        def body(_, s):
            r = jnp.sum(w * s.astype(w.dtype), axis=1, dtype=jnp.float32)
            # Read at a run-time index, so that XLA cannot narrow the reduction to one row.
            return jax.lax.dynamic_index_in_dim(r, (s > 1e30).astype(jnp.int32), keepdims=False) * 1e-30 + 1.0
        return jax.lax.fori_loop(0, FLOOR_STEPS, body, jnp.float32(1.0))

    loop = jax.jit(read, compiler_options=LOOP_GRAPH_OPTIONS)
    w = jax.random.normal(jax.random.key(2), (-(-nbytes // (2 * FLOOR_ROW)), FLOOR_ROW), jnp.bfloat16)
    seconds, clock = _sustained(lambda: loop(w), _rate(lambda: loop(w), calls=1))
    return dict(floor_ms=seconds / FLOOR_STEPS * 1e3, floor_sm_mhz=clock.summary()["sm_mhz"])


def probe_floor(runs: dict) -> dict:
    """measure_floor in a child process (`_child_probe`) for each run's bytes ({name: bytes})."""
    floors = _child_probe("--floor-probe", "no floor in the results", json.dumps(runs))
    if floors is None:
        return {}
    for name, f in floors.items():
        log(f"bench: floor of {name}: its {runs[name] / 1e9:.3f} GB read in {f['floor_ms']:.4f} ms")
    return floors


def _floor_name(batch: int, prompt_len: int) -> str:
    return f"batch {batch}, prompt {prompt_len}"


def _roofline_dtypes(args, dtype) -> tuple:
    """The roofline's names for a run's weights ("int8" for int8 weights) and its KV cache."""
    return ("int8" if args.quant == "int8" else dtype), ("int8" if args.kv_dtype == "int8" else dtype)


def _decode_context(prompt_len: int, new_tokens: int) -> int:
    """The mean context of a run's decode steps: the one its decode step is counted at."""
    return prompt_len + new_tokens // 2


def floor_reads(args) -> dict:
    """Each run's decode reads (weights and KV cache) for `probe_floor`, as `run_one` counts them."""
    from jaxllm.tools import presets, roofline
    cfg = presets.get_config(args.preset or args.model)
    weights, kv_store = _roofline_dtypes(args, args.dtype)
    runs = {}
    for p in args.prompt_len:
        for b in args.batch:
            t = roofline.analyze(cfg, b, _decode_context(p, args.new_tokens), 1, weights, kv_store)["totals"]
            runs[_floor_name(b, p)] = t["weight_bytes"] + t["kv_read_bytes"]
    return runs


# --------------------------------------------------------------------------------------------
# Checkpoints: writing one, and the disk's rate against the load's


def write_checkpoint(args) -> dict:
    from jaxllm.tools import presets
    t0 = time.perf_counter()
    files = presets.write_checkpoint(presets.PRESETS[args.preset], args.write_checkpoint,
                                     seed=args.seed, dtype=args.dtype)
    for f in files:  # on the disk, not only in the page cache
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    return dict(preset=args.preset, checkpoint=args.write_checkpoint, dtype=args.dtype,
                checkpoint_bytes=sum(f.stat().st_size for f in files),
                write_s=time.perf_counter() - t0)


def checkpoint_files(path) -> list[Path]:
    """The files a load of `path` reads: a GGUF file, an HF directory's safetensors (as jaxllm
    finds them), or every file of a `jaxllm convert` directory."""
    from jaxllm.io import hf
    path = Path(path)
    if path.is_file():
        return [path]
    try:
        return hf.safetensor_files(path)
    except ValueError:
        return sorted(p for p in path.rglob("*") if p.is_file())


def drop_from_page_cache(files, flush: bool = True):
    """Ask the kernel to forget the files' cached pages (no root needed), so the next read comes
    from the disk; with `flush`, written pages are flushed first, since dirty ones cannot be
    dropped (installed libraries have none)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            if flush:
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def backend_library_files() -> list[Path]:
    """The shared libraries of JAX's GPU plugin packages and of the nvidia packages (CUDA, cuBLAS,
    cuDNN, NCCL...), where installed: what a GPU backend reads as it starts, the driver's own
    libraries aside. Found without importing them."""
    files = []
    for name in ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin", "nvidia"):
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            files += [f for f in Path(root).rglob("*.so*") if f.is_file() and not f.is_symlink()]
    return files


def disk_bytes_read() -> int | None:
    """Bytes the machine's physical disks have read since boot (the sectors-read counts of
    /sys/block/*/stat, 512 bytes each, for devices backed by hardware: not loop, RAM or mapper
    devices, whose reads land on a physical disk too); None where there are none to read."""
    counts = [int((dev / "stat").read_text().split()[2]) * 512
              for dev in Path("/sys/block").glob("*") if (dev / "device").exists()]
    return sum(counts) if counts else None


def _disk_gb_during(run) -> tuple[object, float | None]:
    """run()'s result, and the GB the disks read meanwhile (None where that is not known)."""
    before = disk_bytes_read()
    result = run()
    after = disk_bytes_read()
    return result, None if before is None or after is None else (after - before) / 1e9


def read_rate(files, piece: int = 64 << 20) -> float:
    """Bytes/s of one plain sequential read of the files into a reused buffer: the disk's rate
    where they are not cached."""
    buf = memoryview(bytearray(piece))
    t0, total = time.perf_counter(), 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total / (time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# One run


def _git_version() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _source_hash() -> str:
    """sha256 (12 hex digits) of the package's and this script's sources: names the code that ran
    even where git metadata is stale or absent (a copied working tree)."""
    import hashlib
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted((root / "jaxllm").glob("*.py")) + [Path(__file__).resolve()]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _model_devices(params) -> list:
    """The devices the model runs on: a sharded model's mesh, else JAX's first device."""
    import jax
    return jax.devices()[:1] if params.tp is None else list(params.tp.mesh.devices.flat)


def _memory(params, batch: int, tokens: int, cache_len: int, kv_dtype, devices=None) -> dict:
    """The allocator's figures of the device using the most (of `devices`, by default the
    model's), beside what the request needs there."""
    from jaxllm.engine import memory

    stats, device = max(((d.memory_stats() or {}, d) for d in devices or _model_devices(params)),
                        key=lambda pair: pair[0].get("peak_bytes_in_use") or 0)
    kv, act = memory.request_bytes(params, batch, tokens, cache_len, kv_dtype)
    need = memory.resident_bytes(params, device) + kv + act
    peak = stats.get("peak_bytes_in_use")
    return dict(activation_bytes=act, peak_bytes_in_use=peak, bytes_in_use=stats.get("bytes_in_use"),
                bytes_limit=stats.get("bytes_limit"), peak_pct_of_need=peak and 100 * peak / need)


def run_one(params, label: dict, batch: int, prompt_len: int, args, peaks: dict,
            floor: dict, prompts: str | None = None) -> dict:
    import jax
    import numpy as np

    import jaxllm
    from jaxllm.engine.generate import bucket, compiler_options, pad_prompts
    from jaxllm.model.cache import cache_bytes, init_cache
    from jaxllm.model.params import param_bytes, param_count
    from jaxllm.model.plan import describe, step_plan
    from jaxllm.model.sharding import TP
    from jaxllm.model.transformer import step
    from jaxllm.tools import roofline, telemetry

    cfg, new = params.config, args.new_tokens
    rng = np.random.default_rng([args.seed, batch, prompt_len])
    ids = rng.integers(0, cfg.vocab_size, size=(batch, prompt_len), dtype=np.int32)
    if args.prompt_file:
        text = Path(args.prompt_file).read_text()
        ids = np.array([jaxllm.load_tokenizer(args.model).encode(text)] * batch, np.int32)
        prompt_len = ids.shape[1]
    stops = []  # random prompts: every row makes all new tokens
    if prompts:  # real prompts: rows end at the model's end of turn, as a user's would
        ids = prompt_set(prompts, jaxllm.load_tokenizer(args.model), batch, prompt_len)
        prompt_len, stops = max(len(r) for r in ids), None

    kv_dtype = "int8" if args.kv_dtype == "int8" else None  # None: the cache follows the model dtype
    speculative = dict(speculative=args.draft, num_speculative=args.num_speculative,
                       synthetic_acceptance=args.synthetic_acceptance) if args.draft is not None else {}

    def generate(**spec):
        return jaxllm.generate(params, ids, max_new_tokens=new, temperature=0.0, eos_token_ids=stops,
                               kv_dtype=kv_dtype, **(spec or speculative))

    spec_fields = {} if prompts is None else dict(prompt_set=prompts)
    if speculative:  # the plain baseline from the same run, then the speculative calls below
        plain_out = _wait(generate(speculative=None))
        plain_tokens = int(np.sum(np.asarray(plain_out.lengths)))
        plain_s, _ = _median_time(lambda: generate(speculative=None), args.repeat)
        from jaxllm.engine import speculative as spec_mod
        spec_fields.update(speculate=args.speculate or args.draft_model or args.draft_preset,
                           draft_quant=args.draft_quant,
                           num_speculative=args.num_speculative, synthetic_acceptance=args.synthetic_acceptance,
                           spec_default_on=batch <= args.spec_max_batch, plain_generate_s=plain_s,
                           plain_tokens=plain_tokens, plain_tokens_per_s=plain_tokens / plain_s,
                           verify_cost=spec_mod.current().verify_cost)

    log(f"bench: {label['preset'] or label['model']} batch {batch}, prompt {prompt_len}, {new} new tokens")
    t0 = time.perf_counter()
    out = _wait(generate())
    first_call_s = time.perf_counter() - t0
    lengths = np.asarray(out.lengths)
    if stops is not None and not (lengths == new).all():
        raise RuntimeError(f"generate stopped early (lengths {sorted(set(lengths.tolist()))}, wanted {new})")
    # The model's devices: a sharded one's slowest sets each step's pace, and its fullest the peak.
    model_devices = _model_devices(params)
    with telemetry.sample(model_devices) as decode_clock:
        generate_s, generate_all = _median_time(generate, args.repeat)
    if speculative:
        stats = out.stats
        made = int(np.sum(lengths))
        same = [np.array_equal(np.asarray(a)[:n], np.asarray(b)[:m]) for a, b, n, m in
                zip(out.tokens, plain_out.tokens, lengths, np.asarray(plain_out.lengths))]
        spec_fields.update(spec=stats.as_dict(), spec_tokens=made, spec_tokens_per_s=made / generate_s,
                           rows_same_as_plain=sum(same) / len(same),
                           speedup=made / generate_s / spec_fields["plain_tokens_per_s"])
        log(f"bench: speculative: {made / generate_s:.1f} tokens/s against {spec_fields['plain_tokens_per_s']:.1f} "
            f"plain ({spec_fields['speedup']:.2f}x); {stats.tokens_per_step:.2f} tokens per target step, "
            f"acceptance {stats.acceptance_rate:.1%}, {stats.verify_rounds} verify rounds of {stats.rounds}, "
            f"histogram {list(stats.histogram)}")
    elif prompts:
        spec_fields.update(tokens=int(np.sum(lengths)))
    tokens, start, _ = pad_prompts(params, ids)
    cache_len = tokens.shape[1] + bucket(new)
    # Memory now: the prefill below, a program of its own, holds more than generate's whole loop
    # did beside the weights (docs/performance.md#what-the-columns-mean).
    memory = _memory(params, batch, int(tokens.shape[1]), cache_len, kv_dtype, model_devices)

    # Prefill alone: one jitted program that, like generate's, allocates a fresh cache of the
    # length generate plans for these prompts and runs `step` over the padded prompt, compiled
    # with the options generate's loop has for these rows. Timed after SUSTAIN_S of prefills,
    # as the matmul rate it is compared with (the GPU's power cap has then taken hold).
    tokens, start = jax.device_put(tokens), jax.device_put(start)
    key = jax.random.key(args.seed)

    @partial(jax.jit, compiler_options=compiler_options(batch, params) or None)
    def prefill_jit(params, tokens, start):
        return step(params, tokens, init_cache(cfg, batch, cache_len, params.dtype, start, kv_dtype),
                    fresh=True)

    def prefill():
        return prefill_jit(params, tokens, start)

    logits, _ = _wait(prefill())  # compiles
    _wait(jaxllm.sample(logits, key))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < SUSTAIN_S:
        _wait(prefill())
    with telemetry.sample(model_devices) as prefill_clock:
        prefill_s, _ = _median_time(prefill, max(5, args.repeat))
    sample_s, _ = _median_time(lambda: jaxllm.sample(logits, key), 10)
    del logits
    ttft_s = prefill_s + sample_s
    steps = new if stops is not None else int(lengths.max())  # real prompts: the longest row's
    decode_s = (generate_s - ttft_s) / (steps - 1) if steps > 1 else float("nan")
    decode_plan = step_plan(params, batch, 1, axis=None if params.tp is None else TP,
                            cache_length=cache_len, kv_int8=kv_dtype == "int8")
    if decode_s <= 0:
        log("bench: generate took no longer than its prefill: too few new tokens to time a decode step")
        decode_s = float("nan")

    devices = label["tp"]  # peaks of the devices together
    matmul_flops = (peaks.get("matmul_tflops") or roofline.H200_BF16_MATMUL_FLOPS / 1e12) * 1e12 * devices
    peak_bw = DATASHEET_BW * devices
    dtype = params.dtype
    weights, kv_store = _roofline_dtypes(args, dtype)
    context = _decode_context(prompt_len, new)
    dec = roofline.analyze(cfg, batch, context, 1, weights, kv_store, peak_bw=peak_bw,
                           peak_flops=matmul_flops, name=label["preset"] or label["model"])
    pre = roofline.analyze(cfg, batch, prompt_len, prompt_len, weights, kv_store, peak_bw=peak_bw,
                           peak_flops=matmul_flops)
    dt, pt = dec["totals"], pre["totals"]
    step_bytes = dt["bytes"]
    achieved = step_bytes / decode_s if decode_s > 0 else float("nan")
    copy_bw = (peaks.get("copy_tbps") or 0) * 1e12 * devices or None
    result = dict(
        label,
        dtype=str(dtype), quant=args.quant, kv_dtype=str(kv_dtype or dtype),
        batch=batch, prompt_len=prompt_len, padded_prompt_len=int(tokens.shape[1]), new_tokens=new,
        cache_len=cache_len, repeat=args.repeat,
        param_count=param_count(params), param_bytes=param_bytes(params),
        kv_cache_bytes=cache_bytes(cfg, batch, cache_len, dtype, kv_dtype),
        first_call_s=first_call_s, compile_s=max(0.0, first_call_s - generate_s),
        generate_s=generate_s, generate_s_all=generate_all,
        prefill_ms=prefill_s * 1e3, prefill_flops=pt["flops"], prefill_tflops=pt["flops"] / prefill_s / 1e12,
        prefill_roofline_ms=pt["time_lb_s"] * 1e3,
        prefill_pct_matmul_peak=100 * pt["flops"] / prefill_s / matmul_flops,
        sample_ms=sample_s * 1e3, ttft_ms=ttft_s * 1e3,
        decode_ms_per_step=decode_s * 1e3, decode_tokens_per_s_per_seq=1 / decode_s,
        decode_tokens_per_s=batch / decode_s, end_to_end_tokens_per_s=int(np.sum(lengths)) / generate_s,
        decode_context_mean=context, weight_bytes_per_step=dt["weight_bytes"],
        kv_bytes_per_step=dt["kv_read_bytes"] + dt["kv_write_bytes"], bytes_per_step=step_bytes,
        achieved_tbps=achieved / 1e12, peak_tbps=peak_bw / 1e12, pct_peak_bw=100 * achieved / peak_bw,
        copy_tbps=copy_bw and copy_bw / 1e12, pct_copy_bw=copy_bw and 100 * achieved / copy_bw,
        matmul_tflops=peaks.get("matmul_tflops"), matmul_tflops_burst=peaks.get("matmul_tflops_burst"),
        copy_tbps_burst=peaks.get("copy_tbps_burst") and peaks["copy_tbps_burst"] * devices,
        **{f"{probe}_{k}": peaks.get(f"{probe}_{k}") for probe in ("copy", "matmul") for k in CLOCK_KEYS},
        **_clock_fields("prefill", prefill_clock), **_clock_fields("decode", decode_clock),
        power_limit_w=prefill_clock.power_limit_w,
        decode_roofline_ms=dt["time_lb_s"] * 1e3, pct_of_roofline=100 * dt["time_lb_s"] / decode_s,
        roofline_tokens_per_s=dt["tokens_per_s_lb"],
        floor_ms=floor.get("floor_ms"), floor_sm_mhz=floor.get("floor_sm_mhz"),
        floor_tokens_per_s=batch / floor["floor_ms"] * 1e3 if floor else None,
        pct_of_floor=100 * floor["floor_ms"] / (decode_s * 1e3) if floor else None,
        decode_paths=describe(decode_plan), **memory, **spec_fields, error=None)
    if speculative:
        # A round's floor (issue 60's): one target step's roofline and k draft steps' weights at the
        # datasheet bandwidth, over the tokens a round made, as decode's roofline is a step's
        draft_bytes = 0 if isinstance(args.draft, str) else param_bytes(args.draft)
        round_s = dt["time_lb_s"] + out.stats.k * draft_bytes / peak_bw
        spec_roofline = batch * out.stats.tokens_per_step / round_s
        result.update(spec_roofline_tokens_per_s=spec_roofline,
                      pct_of_spec_roofline=100 * result["decode_tokens_per_s"] / spec_roofline)

    log(roofline.format_table(dec))
    log(f"decode paths: {result['decode_paths']}")
    log(f"measured: decode {decode_s * 1e3:.3f} ms/step = {result['pct_of_roofline']:.0f}% of the bound, "
        f"{achieved / 1e12:.2f} TB/s ({result['pct_peak_bw']:.0f}% of {peak_bw / 1e12:.1f}"
        + (f", {result['pct_copy_bw']:.0f}% of the measured copy {copy_bw / 1e12:.2f}" if copy_bw else "")
        + f"); {batch / decode_s:.0f} tokens/s in total; prefill {prefill_s * 1e3:.2f} ms "
        f"({result['prefill_tflops']:.0f} TFLOP/s); first call {first_call_s:.2f} s"
        + (f"; its reads alone as one array {floor['floor_ms']:.3f} ms ({result['pct_of_floor']:.0f}% "
           f"of the step, at most {result['floor_tokens_per_s']:.0f} tokens/s)" if floor else ""))

    if args.trace_dir:
        run_dir = Path(args.trace_dir) / f"{(label['preset'] or Path(label['model']).name)}-b{batch}-p{prompt_len}"
        from jaxllm.tools.trace import kernel_view, trace
        with kernel_view():  # compiles the loop whose kernels the profiler sees (not the one timed)
            _wait(generate())
        with trace(run_dir) as recorded:
            _wait(generate())
        log(f"bench: {recorded.how_to_open()}")
        log(str(recorded.summary(top=12)))
    return result


# --------------------------------------------------------------------------------------------
# Plot


def plot(results: list[dict], path: str) -> bool:
    """Write the plot; False (said on stderr) where it could not be written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        log("bench: --plot needs matplotlib, which is not installed; no plot written")
        return False
    ok = [r for r in results if not r.get("error")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prompt_len in sorted({r["prompt_len"] for r in ok}):
        rows = sorted((r for r in ok if r["prompt_len"] == prompt_len), key=lambda r: r["batch"])
        batches = [r["batch"] for r in rows]
        line, = ax.plot(batches, [r["decode_tokens_per_s"] for r in rows], "o-",
                        label=f"measured, prompt {prompt_len}")
        ax.plot(batches, [r["roofline_tokens_per_s"] for r in rows], "--", color=line.get_color(),
                label=f"roofline, prompt {prompt_len}")
    name = ok[0]["preset"] or ok[0]["model"] if ok else ""
    ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s (all rows)",
           title=f"{name} on {ok[0]['device'] if ok else '?'}: measured and roofline "
                 f"({DATASHEET_BW / 1e12:.1f} TB/s)")
    ax.set_xticks(sorted({r["batch"] for r in ok}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as e:  # the directory went away, a full disk, an unknown suffix
        log(f"bench: no plot written to {path}: {e}")
        return False
    finally:
        plt.close(fig)
    log(f"bench: plot in {path}")
    return True


# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.peaks_probe:
        print(json.dumps(measure_peaks()), flush=True)
        return 0
    if args.floor_probe:
        runs = json.loads(sys.stdin.read())
        print(json.dumps({name: measure_floor(n) for name, n in runs.items()}), flush=True)
        return 0
    if args.no_compile_cache:
        os.environ["JAXLLM_NO_COMPILE_CACHE"] = "1"  # read when jaxllm is imported, below
    # Before this process touches the device: the probe's buffers then never share its memory.
    peaks = probe_peaks() if args.measure_peaks else {}
    peaks.setdefault("copy_tbps", args.copy_tbps)
    peaks.setdefault("matmul_tflops", args.matmul_tflops)
    if args.measure_floor:
        try:
            floors = probe_floor(floor_reads(args))
        except ValueError as e:  # a checkpoint whose config cannot be read
            return _usage_error(f"--measure-floor: {e}")
    else:
        floors = {}

    from jaxllm.tools import presets
    if (args.write_checkpoint or not args.model) and args.preset not in presets.PRESETS:
        log(f"bench: unknown preset {args.preset!r}; presets: {', '.join(presets.PRESETS)}")
        return 2
    if args.write_checkpoint:
        try:
            written = write_checkpoint(args)
        except ValueError as e:  # the directory filled since the flags were checked
            return _usage_error(f"--write-checkpoint: {e}")
        print(json.dumps(written), flush=True)
        return 0

    import jax
    import jaxlib

    import jaxllm
    from jaxllm.model.params import quantize_params

    dtype = jax.numpy.dtype(args.dtype)
    mesh = None
    if args.tp > 1:
        from jaxllm.model.sharding import make_mesh
        try:
            mesh = make_mesh(args.tp)
        except ValueError as e:  # more devices than are visible
            return _usage_error(f"--tp {args.tp}: {e}")
    loading = {}
    if args.model:
        files = checkpoint_files(args.model)
        if args.cold:
            drop_from_page_cache(files)
            rate, loading["disk_gb_read_in_plain_read"] = _disk_gb_during(lambda: read_rate(files))
            loading["disk_read_gb_per_s"] = rate / 1e9
            drop_from_page_cache(files)
        if args.fresh:
            started = getattr(jax._src.xla_bridge, "backends_are_initialized", lambda: False)
            if started():  # its libraries are mapped, so they stay cached
                log("bench: --fresh: the backend started before the load; its libraries stay cached")
            drop_from_page_cache(backend_library_files(), flush=False)
        t0 = time.perf_counter()
        try:
            params, disk_gb = _disk_gb_during(lambda: _wait(jaxllm.load(
                args.model, dtype=dtype, quant=args.quant, mesh=mesh, expert_parallel=args.expert_parallel)))
        except (ValueError, FileNotFoundError) as e:  # not a checkpoint, or not one for this mesh
            return _usage_error(f"--model {args.model}: {e}")
        loading["load_s"] = time.perf_counter() - t0
        if args.cold:
            loading["disk_gb_read_in_load"] = disk_gb
        loading["checkpoint_bytes"] = sum(f.stat().st_size for f in files)
        loading["load_gb_per_s"] = loading["checkpoint_bytes"] / loading["load_s"] / 1e9
        loading["cold"], loading["fresh"] = args.cold, args.fresh
    else:
        cfg = presets.PRESETS[args.preset]
        if cfg.num_experts and not importlib.util.find_spec("jaxllm.layers.moe"):
            log(f"bench: {args.preset} is a mixture of experts, which is not implemented yet in jaxllm")
            return 2
        t0 = time.perf_counter()
        if mesh is not None:
            from jaxllm.model.sharding import init_sharded
            try:  # a shape the mesh cannot split, int8 of sharded params: named by the library
                params = _wait(init_sharded(cfg, jax.random.key(args.seed), mesh, dtype,
                                            expert_parallel=args.expert_parallel))
                if args.quant == "int8":  # quantize_params names what sharded params lack
                    params = _wait(quantize_params(params))
            except ValueError as e:
                return _usage_error(f"--tp {args.tp}: {e}")
        else:  # int8: each matrix quantized as it is drawn, so the float model is never held whole
            params = _wait(presets.random_params(cfg, args.seed, dtype, quant=args.quant))
        log(f"bench: random {args.preset} weights{' in int8' if args.quant == 'int8' else ''} on "
            f"{jax.devices()[0].device_kind} in {time.perf_counter() - t0:.1f} s")
    label = dict(preset=args.preset, model=args.model, device=jax.devices()[0].device_kind,
                 platform=jax.default_backend(), jax_version=jax.__version__,
                 jaxlib_version=jaxlib.__version__, git=_git_version(), source=_source_hash(), tp=args.tp,
                 env={k: v for k, v in sorted(os.environ.items()) if k.startswith(("JAXLLM_", "XLA_FLAGS"))},
                 compile_cache=jax.config.jax_compilation_cache_dir, **loading)
    if args.load_only:  # what was loaded, as a run's line names it
        line = dict(label, dtype=str(dtype), quant=args.quant)
        print(json.dumps(_finite(line), allow_nan=False, default=str), flush=True)
        return 0

    args.draft = args.speculate
    # the draft's quantization, as each run's line reports it (None: no draft model)
    args.draft_quant = (args.draft_quant or args.quant) if args.draft_model or args.draft_preset else None
    if args.draft_model:
        args.draft = _wait(jaxllm.load(args.draft_model, dtype=dtype, quant=args.draft_quant, mesh=mesh))
    elif args.draft_preset:
        if args.draft_preset not in presets.PRESETS:
            return _usage_error(f"--draft-preset: unknown preset {args.draft_preset!r}")
        args.draft = _wait(presets.random_params(presets.PRESETS[args.draft_preset], args.seed + 1, dtype,
                                                 quant=args.draft_quant))
    if args.draft is not None:
        # Speculation is timed at every batch; spec_default_on says whether generate's default
        # (which decodes plainly above SpecTuning.batch_limit rows) would speculate there.
        import dataclasses
        from jaxllm.engine import speculative as spec_mod
        args.spec_max_batch = spec_mod.current().batch_limit(
            spec_mod.NGram() if isinstance(args.draft, str) else spec_mod.Draft())
        spec_mod.TUNING = dataclasses.replace(spec_mod.current(), max_batch=MAX_SIZE, max_batch_draft=MAX_SIZE)
    # Each run is a new shape on purpose: jaxllm's warning about recompiling is noise here.
    warnings.filterwarnings("ignore", message="jaxllm: recompiling")
    results, failed = [], False
    for prompts in args.prompt_set or [None]:
        for prompt_len in args.prompt_len:
            for batch in args.batch:
                if args.verify:
                    failed |= not run_verify(params, label, batch, prompt_len, args)
                    continue
                try:
                    result = run_one(params, label, batch, prompt_len, args, peaks,
                                     floors.get(_floor_name(batch, prompt_len), {}), prompts)
                except Exception as e:  # one failed shape (out of memory, over the context) ends only that run
                    failed = True
                    log(f"bench: batch {batch}, prompt {prompt_len} failed: {type(e).__name__}: {e}")
                    result = dict(label, batch=batch, prompt_len=prompt_len, new_tokens=args.new_tokens,
                                  error=f"{type(e).__name__}: {e}", **({"prompt_set": prompts} if prompts else {}))
                results.append(result)
                print(json.dumps(_finite(result), allow_nan=False, default=str), flush=True)
    if args.plot and not plot(results, args.plot):
        failed = True
    return 1 if failed else 0


def run_verify(params, label: dict, batch: int, prompt_len: int, args) -> bool:
    """--verify's lines for one (batch, prompt length), printed as they come; False if one failed."""
    import jax
    import jax.numpy as jnp

    from jaxllm.engine.generate import compiler_options, spec_cache_length
    from jaxllm.model.cache import init_cache
    from jaxllm.model.plan import step_plan
    from jaxllm.model.transformer import rotation_table, step

    cfg = params.config
    kv_dtype = "int8" if args.kv_dtype == "int8" else None
    tokens_per_row = [1] + [t for t in dict.fromkeys(args.verify) if t != 1]
    # As a speculative generate's cache: prompt, room for the longest step, whole 64-slot blocks.
    cache_len = spec_cache_length(prompt_len, 0, max(tokens_per_row) - 1)
    options = compiler_options(batch, params) or None
    key = jax.random.key(args.seed)
    prompt = jax.random.randint(key, (batch, prompt_len), 0, cfg.vocab_size, jnp.int32)
    warm = jax.jit(lambda params, tokens: step(
        params, tokens, init_cache(cfg, batch, cache_len, params.dtype, kv_dtype=kv_dtype), fresh=True)[1])
    rotation = rotation_table(cfg, cache_len)

    def loop(params, cache, tokens_BT, rotation, *, T):
        def body(_, carry):
            tokens_BT, cache = carry
            logits, cache = step(params, tokens_BT, cache, rotation=rotation, all_logits=T > 1)
            tokens_BT = jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(batch, T)
            return tokens_BT, cache.replace(end=cache.end - T)  # the same context every step
        return jax.lax.fori_loop(0, VERIFY_STEPS, body, (tokens_BT, cache))[0]

    log(f"bench: {label['preset'] or label['model']} batch {batch}, prompt {prompt_len}: steps of "
        f"{tokens_per_row} tokens a row")
    one_ms, ok = None, True
    for T in tokens_per_row:
        try:
            cache = _wait(warm(params, prompt))
            run = jax.jit(partial(loop, T=T), compiler_options=options)
            tokens = jax.random.randint(jax.random.fold_in(key, T), (batch, T), 0, cfg.vocab_size, jnp.int32)
            _wait(run(params, cache, tokens, rotation))  # compiles
            seconds, all_s = _median_time(lambda: run(params, cache, tokens, rotation), args.repeat)
            plan = step_plan(params, batch, T, cache_length=cache_len, kv_int8=kv_dtype is not None)
            step_ms = seconds / VERIFY_STEPS * 1e3
            one_ms = step_ms if T == 1 else one_ms
            result = dict(label, dtype=str(params.dtype), quant=args.quant, kv_dtype=str(kv_dtype or params.dtype),
                          batch=batch, prompt_len=prompt_len, cache_len=cache_len, tokens_per_row=T,
                          steps=VERIFY_STEPS, repeat=args.repeat, step_ms=step_ms,
                          step_ms_all=[t / VERIFY_STEPS * 1e3 for t in all_s], ms_per_token=step_ms / T,
                          vs_one_token=one_ms and step_ms / one_ms, attention=plan.attention,
                          projection=plan.layers[0].projection.family)
            log(f"bench: {T} tokens a row: {step_ms:.4f} ms a step"
                + (f", {step_ms / one_ms:.3f}x one token's" if one_ms and T > 1 else ""))
        except Exception as e:  # one failed shape (out of memory) ends only that line
            ok = False
            log(f"bench: batch {batch}, prompt {prompt_len}, {T} tokens a row failed: {type(e).__name__}: {e}")
            result = dict(label, batch=batch, prompt_len=prompt_len, tokens_per_row=T,
                          error=f"{type(e).__name__}: {e}")
        print(json.dumps(_finite(result), allow_nan=False, default=str), flush=True)
    return ok


def _finite(value):
    """NaN and infinities become null: strict JSON readers refuse them."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


if __name__ == "__main__":
    sys.exit(main())
