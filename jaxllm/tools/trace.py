"""Profiler traces a user can read, a text summary of them, and a warning on surprise recompiles.

`trace(dir)` records a `jax.profiler` trace of the work inside it. The run lands in
`dir/plugins/profile/<timestamp>/`: `*.xplane.pb` (TensorBoard / XProf), `*.trace.json.gz` (Chrome
trace events) and `perfetto_trace.json.gz` (ui.perfetto.dev). Trace steady-state work: compile and
warm up before entering, or let `trace_steady` do it. `summarize(dir)` reads the trace back: the
top XLA ops by device time (on CPU, by the host threads that run them) with their share, the
share of each named scope of the model (prefill/decode, layer_i, attention, mlp, moe, lm_head,
sampling) and that of the collectives (a sharded model's all-reduces and all-gathers). The scopes
come from the HLO the profiler stores in the xplane file, whose op metadata carries the
`jax.named_scope` path of every instruction.

The recompile warnings and `kernel_view` live in engine/compile.py, on the generate path; they
are named here too, where a user of the traces looks for them.

The module is callable: `jaxllm.trace(dir)` is `jaxllm.tools.trace.trace(dir)`, so the context manager
and the module's other names (`jaxllm.tools.trace.summarize`) live under one name without shadowing.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gzip
import json
import os
import re
import sys
import types
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import jax

from jaxllm.checks import whole
from jaxllm.engine.compile import RecompileWarning, kernel_view  # noqa: F401 (a trace user's names)

# ----------------------------------------------------------------------------------------------
# Taking a trace


def profile_options(detail: bool = False) -> jax.profiler.ProfileOptions:
    """Profiler options: lean by default; `detail` adds Python call stacks and verbose host events.

    Device kernels are recorded one by one either way, also those XLA replays from a command
    buffer (CUDA graph): CUPTI reports each kernel of a graph, labelled with the buffer as its op,
    and `summarize` maps them back to their instructions. The CUPTI option that records a graph as
    one event (`gpu_enable_cupti_activity_graph_trace`) would hide those kernels; it is not used.
    """
    opts = jax.profiler.ProfileOptions()
    # The Python tracer records every Python call: large traces and host time that is not ours.
    opts.python_tracer_level = 1 if detail else 0
    opts.host_tracer_level = 3 if detail else 2
    return opts


@dataclasses.dataclass
class Trace:
    """Where a trace was written; filled in when the `trace` block exits."""

    log_dir: Path
    detail: bool = False
    run_dir: Path | None = None  # log_dir/plugins/profile/<timestamp>
    output: Any = None  # the last result of `trace_steady`'s function

    @property
    def perfetto_file(self) -> Path | None:
        p = self.run_dir / "perfetto_trace.json.gz" if self.run_dir else None
        return p if p is not None and p.exists() else None

    def summary(self, top: int = 15) -> "Summary":
        return summarize(self.run_dir or self.log_dir, top=top)

    def how_to_open(self) -> str:
        """A few lines telling the user where the trace is and how to look at it."""
        where = self.run_dir or self.log_dir
        lines = [f"trace written to {where}"]
        if self.perfetto_file:
            lines.append(f"  Perfetto: open https://ui.perfetto.dev and drop in {self.perfetto_file}")
        lines.append(f"  XProf:    xprof --logdir {self.log_dir} --port 8791, then http://localhost:8791 "
                     "(pip install xprof)")
        return "\n".join(lines)


@contextlib.contextmanager
def trace(log_dir: str | os.PathLike, *, detail: bool = False, perfetto: bool = True) -> Iterator[Trace]:
    """Record a profiler trace of the block into `log_dir` (viewable in Perfetto and XProf).

    Warm up (compile) before entering, inside `kernel_view` if the block calls `generate`:
    compilation inside the block is traced too and swamps the steady state. Block on the results
    inside (`jax.block_until_ready`): work still queued when the block exits is cut off.
    `detail=True` adds Python call stacks and verbose host events.
    """
    info = Trace(_log_dir(log_dir), detail=detail)
    before = set(_run_dirs(info.log_dir))
    jax.profiler.start_trace(str(info.log_dir), create_perfetto_trace=perfetto,
                             profiler_options=profile_options(detail))
    try:
        with kernel_view():
            yield info
    finally:
        jax.profiler.stop_trace()
        runs = _run_dirs(info.log_dir)
        new = [r for r in runs if r not in before] or runs
        info.run_dir = max(new, key=lambda p: p.stat().st_mtime) if new else None


def trace_steady(fn: Callable[[], Any], log_dir: str | os.PathLike, *, warmup: int = 1, runs: int = 1,
                 detail: bool = False) -> Trace:
    """Call `fn()` `warmup` times untraced (compiling it), then trace `runs` more calls.

    Each call is blocked on, so the trace holds whole calls and nothing of the warm-up.
    The returned `Trace` carries the last call's result in `.output`.
    """
    if not callable(fn):
        raise TypeError(f"trace_steady's fn must be a function of no arguments, got {type(fn).__name__}")
    warmup = whole("warmup", warmup, 0, None, floats=False, kind_error=TypeError)
    # no run traced: an empty trace, refused only by summary()
    runs = whole("runs", runs, 1, None, floats=False, kind_error=TypeError)
    log_dir = _log_dir(log_dir)  # before the warm-up: a bad path is found before minutes of work
    if warmup < 1:
        warnings.warn("trace_steady(warmup=0): compilation will be part of the trace", stacklevel=2)
    with kernel_view():
        for _ in range(warmup):
            jax.block_until_ready(fn())
        with trace(log_dir, detail=detail) as info:
            for _ in range(runs):
                info.output = jax.block_until_ready(fn())
    return info


def _log_dir(log_dir) -> Path:
    """The trace directory, made if missing; a ValueError naming it where it cannot be."""
    path = Path(log_dir)
    if not str(log_dir).strip():
        raise ValueError("empty trace directory: give the directory to write the trace under")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory: a trace is a directory of runs")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission, a read-only disk
        raise ValueError(f"cannot make the trace directory {path}: {e.strerror or e}") from None
    return path


def _run_dirs(log_dir: Path) -> list[Path]:
    root = log_dir / "plugins" / "profile"
    return [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []


# ----------------------------------------------------------------------------------------------
# Reading a trace back


class OpTime(NamedTuple):
    name: str  # the HLO instruction (fusion, custom-call, copy ...) or kernel name
    seconds: float  # its own time, nested ops excluded, summed over the trace
    share: float  # of the time of all ops in the trace
    scope: str  # its jax.named_scope path, e.g. "decode/layer_3/mlp/dot_general"; "" if unknown


class Summary(list):
    """The top ops (a list of `OpTime`), plus the time of every op grouped by named scope.

    `scopes` maps each phase (prefill, decode, "other phase") and each block (attention, mlp, moe,
    lm_head, sampling, "other block") to its share of all op time; `layers` maps layer_i to its;
    `collectives` is the share of the ops that move data between devices (`is_collective`).
    """

    def __init__(self, ops, *, total_s: float, scopes: dict[str, float], layers: dict[str, float],
                 source: str, device: bool, collectives: float = 0.0):
        super().__init__(ops)
        self.total_s = total_s
        self.scopes = scopes
        self.layers = layers
        self.collectives = collectives
        self.source = source
        self.device = device  # True: GPU/TPU kernel time; False: XLA ops on CPU threads

    def __str__(self) -> str:
        where = "device" if self.device else "XLA op (CPU)"
        out = [f"top {len(self)} ops by {where} time; all ops: {_fmt_s(self.total_s)}  [{self.source}]",
               f"  {'share':>6}  {'time':>10}  {'op':<44} scope"]
        for op in self:
            out.append(f"  {op.share:6.1%}  {_fmt_s(op.seconds):>10}  {op.name[:44]:<44} {op.scope}")
        for title, keys in (("phase", PHASES), ("block", BLOCKS)):
            parts = [f"{k} {self.scopes[k]:.1%}" for k in (*keys, f"other {title}") if self.scopes.get(k)]
            if parts:
                out.append(f"  by {title}: " + ", ".join(parts))
        if self.layers:
            hot = sorted(self.layers.items(), key=lambda kv: -kv[1])[:3]
            out.append("  hottest layers: " + ", ".join(f"{k} {v:.1%}" for k, v in hot))
        if self.collectives:
            out.append(f"  collectives (all-reduce, all-gather, ...): {self.collectives:.1%} "
                       f"({_fmt_s(self.collectives * self.total_s)})")
        return "\n".join(out)


# A sharded model's collectives: their HLO opcodes, and the JAX primitives whose names end the
# scope of what XLA made of them (on a GPU a small all-reduce is a fusion running XLA's own
# one-shot kernel, named after the psum, e.g. `psum.96.0-fusion.1`, not an all-reduce op).
_COLLECTIVE_OPCODES = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|"
                                 r"collective-broadcast|ragged-all-to-all)(-start|-done)?$")
_COLLECTIVE_SCOPES = {"psum", "pmax", "pmin", "all_gather", "psum_scatter", "reduce_scatter",
                      "all_to_all", "ppermute", "ragged_all_to_all"}


def is_collective(opcode: str, scope: str) -> bool:
    """Whether an op (HLO opcode, named-scope path) moves data between devices."""
    return bool(_COLLECTIVE_OPCODES.match(opcode)) or scope.rsplit("/", 1)[-1] in _COLLECTIVE_SCOPES


PHASES = ("prefill", "decode")
BLOCKS = ("attention", "mlp", "moe", "router", "experts", "lm_head", "sampling")
_LAYER = re.compile(r"layer_\d+$")
# Components of an op_name path that say how JAX traced it, not where in the model it is.
_NOISE = re.compile(r"^(jit|pjit|jvp|transpose|vmap|remat|checkpoint|shard_map|custom_jvp_call|"
                    r"custom_vjp_call)\(.*\)$|^(while|body|cond|branch_\d+|closed_call|core_call)$")
# Loops and calls span their body's ops (which may run on other threads): the body is counted.
_CONTAINERS = {"while", "conditional", "call", "async-start", "async-done"}
_CONTAINER_NAME = re.compile(r"^(while|conditional|call)\b", re.IGNORECASE)
# Instructions that launch no kernel of their own.
_NO_KERNEL = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all",
              "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain", *_CONTAINERS}
_COMMAND_BUFFER = re.compile(r"^command_buffer")


def summarize(trace_dir: str | os.PathLike, top: int | None = 15) -> Summary:
    """The `top` ops (None: all) by device time in the latest trace under `trace_dir`, with shares.

    `trace_dir` is the directory given to `trace` (its newest run is read), a run directory, or a
    `.trace.json.gz` file. Shares are of the time of all ops. An op's time excludes ops nested in
    it, and loops and calls are left out: their bodies' ops are counted instead.
    """
    if top is not None:
        top = whole("top", top, 0, None, floats=False, kind_error=TypeError)
    run_dir, json_files = _trace_files(Path(trace_dir))
    modules = _hlo_modules(run_dir)
    times: dict[tuple[_Module | None, str], float] = collections.defaultdict(float)
    device = False
    for f in json_files:
        events = _read_events(f)
        try:
            timed, on_device = _own_times(events)
        except (KeyError, TypeError, AttributeError) as e:  # events without the fields Chrome's have
            raise ValueError(f"{f}: not a Chrome trace of XLA ops (an event lacks or mangles {e})") from None
        device |= on_device
        for (module, op), secs in _attribute(timed, modules).items():
            opcode = module.opcode(op) if module else ""
            if opcode in _CONTAINERS or (not opcode and _CONTAINER_NAME.match(op)):
                continue
            times[(module, op)] += secs
    total = sum(times.values())
    if total <= 0:
        raise ValueError(f"no XLA op events in the trace at {trace_dir}: was anything run inside it?")
    scoped: dict[str, float] = collections.defaultdict(float)
    layers: dict[str, float] = collections.defaultdict(float)
    rows, collectives = [], 0.0
    for (module, op), secs in times.items():
        scope = module.scope(op) if module else ""
        if is_collective(module.opcode(op) if module else "", scope):
            collectives += secs / total
        parts = scope.split("/") if scope else []
        scoped[next((p for p in parts if p in PHASES), "other phase")] += secs / total
        scoped[next((p for p in reversed(parts) if p in BLOCKS), "other block")] += secs / total
        layer = next((p for p in parts if _LAYER.match(p)), None)
        if layer:
            layers[layer] += secs / total
        rows.append(OpTime(op, secs, secs / total, scope))
    rows.sort(key=lambda r: -r.seconds)
    return Summary(rows if top is None else rows[:top], total_s=total, scopes=dict(scoped),
                   layers=dict(layers), source=str(json_files[0].parent), device=device,
                   collectives=collectives)


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def _read_events(f: Path) -> list[dict]:
    """The `traceEvents` of a gzipped Chrome trace; a ValueError naming the file if it is none."""
    try:
        with gzip.open(f, "rt") as fh:
            data = json.load(fh)
    except (OSError, EOFError, zlib.error, ValueError) as e:  # not gzip, cut short, damaged, not JSON
        hint = (": summarize reads the *.trace.json.gz beside it (give the run folder)"
                if f.name.endswith(".xplane.pb") else "")
        raise ValueError(f"{f} is not a gzipped Chrome trace (.trace.json.gz){hint}: {e}") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{f} is not a Chrome trace: want an object whose traceEvents is a list of "
                         "event objects")
    return events


def _trace_files(path: Path) -> tuple[Path, list[Path]]:
    if path.is_file():
        return path.parent, [path]
    run = path
    runs = _run_dirs(path)
    if runs:
        run = max(runs, key=lambda p: p.stat().st_mtime)
    # One trace.json.gz per host; perfetto_trace.json.gz holds the same events again.
    files = sorted(run.glob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {path}: not a jaxllm.trace directory")
    return run, files


def _own_times(events: list[dict]) -> tuple[list[tuple[dict, float]], bool]:
    """The op events of a Chrome trace with their own time in seconds; and whether on a device.

    On a GPU (or TPU) the ops are the kernels and copies on the device's stream lines; its other
    lines (XLA Ops, XLA Modules, steps) are derived from them and would count them again. On a CPU,
    XLA's thunks run on host threads and each event names its HLO op. An event's own time excludes
    the events nested in it on the same line.
    """
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device_pids = {pid for pid, name in procs.items() if name.startswith("/device:")}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if device_pids:
        chosen = [e for e in complete if e["pid"] in device_pids
                  and threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]
        chosen = chosen or [e for e in complete if e["pid"] in device_pids]
    else:
        chosen = [e for e in complete if "hlo_op" in e.get("args", {})]
    out: list[tuple[dict, float]] = []
    by_line = collections.defaultdict(list)
    for e in chosen:
        by_line[(e["pid"], e.get("tid"))].append(e)
    for line in by_line.values():
        line.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, event, own time]
        for e in line:
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1][0] <= start:
                _, done, own = stack.pop()
                out.append((done, own))
            if stack:  # nested: its time is not its parent's own time
                stack[-1][2] -= min(end, stack[-1][0]) - start
            stack.append([end, e, e["dur"]])
        out.extend((done, own) for _, done, own in stack)
    # Chrome trace events are in microseconds.
    return [(e, max(own, 0.0) * 1e-6) for e, own in out], bool(device_pids)


def _attribute(timed: list[tuple[dict, float]], modules: dict[str, list["_Module"]]
               ) -> dict[tuple["_Module | None", str], float]:
    """Seconds per (compiled module, instruction), command-buffer kernels traced back to theirs.

    Programs share names (prefill and decode are both `jit_step`), so each event is matched to
    the program that has its op: by the op's unique id where the trace records it (GPU), else by
    which program holds all the ops of one execution (`run_id`, CPU) or of the trace.

    A kernel replayed from an XLA command buffer (a CUDA graph) is recorded with the buffer as its
    op (`command_buffer_81`). Its name is that of the fusion it was compiled for, but XLA reuses
    one kernel for identical fusions (the same norm in every layer), so the name alone would put
    every layer's time on layer 0. One replay's kernels run in the order of the computation's
    schedule: aligning the two sequences gives each kernel its own instruction.
    """
    times: dict[tuple[_Module | None, str], float] = collections.defaultdict(float)
    replays: dict[tuple, list[tuple[dict, float]]] = collections.defaultdict(list)
    runs: dict[tuple, list[tuple[dict, float]]] = collections.defaultdict(list)
    for e, secs in timed:
        args = e.get("args", {})
        module, op = args.get("hlo_module", ""), args.get("hlo_op", "")
        if _COMMAND_BUFFER.match(op):
            replays[(e["pid"], e.get("tid"), module, op, args.get("correlation_id"))].append((e, secs))
        else:
            runs[(module, args.get("run_id"))].append((e, secs))
    for (module, _), items in runs.items():
        variants = modules.get(module, [])
        seen = {e.get("args", {}).get("hlo_op") or e["name"] for e, _ in items}
        coverage = {id(v): len(seen & v.instrs.keys()) for v in variants}
        for e, secs in items:
            op = e.get("args", {}).get("hlo_op") or e["name"]
            uid = e.get("args", {}).get("unique_hlo_op_id")
            having = [v for v in variants if op in v.instrs]
            if uid is not None and any(str(v.ids.get(op)) == str(uid) for v in having):
                having = [v for v in having if str(v.ids.get(op)) == str(uid)]
            best = max(having, key=lambda v: coverage[id(v)], default=None)
            times[(best, op)] += secs
    for (_, _, module, _, _), items in replays.items():
        items.sort(key=lambda item: item[0]["ts"])
        kernels = tuple(e["name"] for e, _ in items)
        scored = [(v.align(kernels), v) for v in modules.get(module, [])]
        (score, placed), best = max(scored, key=lambda sv: sv[0][0], default=((0, None), None))
        for i, (e, secs) in enumerate(items):
            name = placed[i] if placed else None
            if name is None and best is not None:
                name = best.by_kernel_name(e["name"])
            times[(best, name or e["name"])] += secs
    return times


# --- the HLO stored in the xplane file ----------------------------------------------------------
# A minimal protobuf reader: the XSpace proto (tsl/profiler/protobuf/xplane.proto) and HloProto
# (xla/service/hlo.proto) field numbers below are stable parts of the on-disk format.


def _kernel_class(kernel: str) -> str:
    """'loop_convert_fusion_4' -> 'loop_convert_fusion': kernels are named after their fusion
    (a Pallas kernel after its pallas_call's name: 'decode_project__2' -> 'decode_project')."""
    return re.sub(r"_+\d+$", "", kernel)


def _instr_class(name: str) -> str:
    """'loop_convert_fusion.4' -> 'loop_convert_fusion', spelled as kernel names are."""
    return re.sub(r"[^A-Za-z0-9_]", "_", re.sub(r"\.\d+$", "", name))


class _Module:
    """One compiled HLO module: each instruction's scope and opcode, and the kernel order."""

    def __init__(self, name: str, instrs: dict[str, tuple[str, str]], schedules: list[list[str]],
                 ids: dict[str, int] | None = None):
        self.name = name
        self.instrs = instrs  # instruction -> (scope, opcode)
        self.ids = ids or {}  # instruction -> its unique id (the trace's `unique_hlo_op_id`)
        # Per scheduled computation, its kernel-launching instructions in execution order.
        self.schedules = [[n for n in seq if instrs.get(n, ("", ""))[1] not in _NO_KERNEL]
                          for seq in schedules]
        self._kernels = {_SANITIZE.sub("_", n): n for n in instrs}
        self._classes = {n: self._class(n) for n in instrs}
        self._aligned: dict[tuple[str, ...], tuple[int, list[str | None] | None]] = {}

    def scope(self, op: str) -> str:
        return self.instrs.get(op, ("", ""))[0]

    def opcode(self, op: str) -> str:
        return self.instrs.get(op, ("", ""))[1]

    def _class(self, op: str) -> str:
        """The kernel class of instruction `op`: its name without the number, or for a Pallas
        call (`pallas_call.12`, scope '.../decode_project/pallas_call') the kernel's name."""
        scope, opcode = self.instrs[op]
        parts = scope.split("/")
        if opcode == "custom-call" and len(parts) > 1 and parts[-1] == "pallas_call":
            return _SANITIZE.sub("_", parts[-2])
        return _instr_class(op)

    def by_kernel_name(self, kernel: str) -> str | None:
        return self._kernels.get(kernel)

    def align(self, kernels: tuple[str, ...], lookahead: int = 4) -> tuple[int, list[str | None] | None]:
        """(kernels matched, the instruction of each kernel) of one command-buffer replay.

        Tries each scheduled computation and start; a kernel matches the next instruction of its
        class within `lookahead` (library and copy kernels match nothing). The best placement
        must be unique and match at least 90% of the kernels that could match, else it is None.
        """
        if kernels in self._aligned:
            return self._aligned[kernels]
        classes = [_kernel_class(k) for k in kernels]
        known = set(self._classes.values())
        matchable = sum(c in known for c in classes)
        best: tuple[int, list | None] = (0, None)
        tied = False
        anchor = next((i for i, c in enumerate(classes) if c in known), None)
        for seq in self.schedules if anchor is not None else []:
            seq_classes = [self._classes.get(n) or _instr_class(n) for n in seq]
            for start in range(len(seq)):
                if seq_classes[start] != classes[anchor]:
                    continue
                placed: list[str | None] = [None] * len(kernels)
                j, score = start, 0
                for i in range(anchor, len(kernels)):
                    for d in range(lookahead):
                        if j + d < len(seq) and seq_classes[j + d] == classes[i]:
                            placed[i], j, score = seq[j + d], j + d + 1, score + 1
                            break
                if score > best[0]:
                    best, tied = (score, placed), False
                elif score == best[0] and placed != best[1]:
                    tied = True
        ok = best[1] is not None and not tied and best[0] >= 0.9 * matchable
        result = (best[0], best[1]) if ok else (0, None)
        self._aligned[kernels] = result
        return result


_SANITIZE = re.compile(r"[^A-Za-z0-9_]")


def _hlo_modules(run_dir: Path) -> dict[str, list[_Module]]:
    """{hlo module name: its compiled programs} from the run's `*.xplane.pb` files (the profiler
    stores the HLO of every program of the process); empty if there is none or it is unreadable."""
    out: dict[str, list[_Module]] = collections.defaultdict(list)
    for f in sorted(run_dir.glob("*.xplane.pb")):
        try:
            for module_proto in _hlo_protos(memoryview(f.read_bytes())):
                module = _read_module(module_proto)
                out[module.name].append(module)
        except (ValueError, IndexError, UnicodeDecodeError):
            continue  # a format we cannot read: ops are still listed, only without scopes
    return dict(out)


def _varint(b, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        c = b[i]
        i += 1
        result |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return result, i


def _fields(b) -> Iterator[tuple[int, Any]]:
    """(field number, value) of a serialized message: ints for varints, memoryviews for the rest."""
    i, n = 0, len(b)
    while i < n:
        key, i = _varint(b, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(b, i)
        elif wire == 2:
            size, i = _varint(b, i)
            value, i = b[i:i + size], i + size
        elif wire == 1:
            value, i = b[i:i + 8], i + 8
        elif wire == 5:
            value, i = b[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, value


def _message(b) -> dict[int, list]:
    d = collections.defaultdict(list)
    for k, v in _fields(b):
        d[k].append(v)
    return d


def _str(v) -> str:
    return bytes(v).decode()


def _packed(values) -> list[int]:
    """A repeated int64 field, packed (one bytes value) or not."""
    out = []
    for v in values:
        if isinstance(v, int):
            out.append(v)
            continue
        j = 0
        while j < len(v):
            x, j = _varint(v, j)
            out.append(x)
    return out


def _hlo_protos(xspace) -> Iterator[Any]:
    """The serialized HloModuleProto of each program in an XSpace's /host:metadata plane."""
    for field, plane in _fields(xspace):
        if field != 1:  # XSpace.planes
            continue
        p = _message(plane)
        if not p[2] or _str(p[2][0]) != "/host:metadata":  # XPlane.name
            continue
        stat_names = {}
        for entry in p[5]:  # XPlane.stat_metadata: map<int64, XStatMetadata>
            m = _message(_message(entry)[2][0])
            stat_names[m[1][0]] = _str(m[2][0]) if m[2] else ""
        for entry in p[4]:  # XPlane.event_metadata: one per compiled program
            meta = _message(_message(entry)[2][0])
            for stat in meta[5]:  # XEventMetadata.stats
                s = _message(stat)
                if s[1] and stat_names.get(s[1][0]) == "Hlo Proto" and s[6]:  # XStat.bytes_value
                    yield _message(s[6][0])[1][0]  # HloProto.hlo_module


def _read_module(module_proto) -> _Module:
    """An HloModuleProto's instructions (scope, opcode) and schedule.

    Backend passes drop the metadata of some instructions (CPU dot fusions, library calls). Such
    an instruction takes the most common scope of the instructions it calls, else the scope
    (without its final primitive) of its operands: a dot lives in the block of its input.
    """
    m = _message(module_proto)
    name = _str(m[1][0])  # HloModuleProto.name
    comps: dict[int, list[int]] = {}  # computation id -> instruction ids
    instrs: dict[int, tuple[str, str, list[int], list[int]]] = {}  # id -> (name, scope, operands, called)
    opcodes: dict[int, str] = {}
    tracing_only: set[int] = set()
    for comp in m[3]:  # HloModuleProto.computations
        c = _message(comp)
        ids = comps.setdefault(c[5][0] if c[5] else -len(comps) - 1, [])  # HloComputationProto.id
        for ins in c[2]:  # HloComputationProto.instructions
            i = _message(ins)
            op_name = ""
            if i[7]:  # HloInstructionProto.metadata -> OpMetadata.op_name (2)
                md = _message(i[7][0])
                op_name = _str(md[2][0]) if md[2] else ""
            iid = i[35][0] if i[35] else -len(instrs) - 1  # .id; .operand_ids 36; .called_computation_ids 38
            instrs[iid] = (_str(i[1][0]), _clean_scope(op_name), _packed(i[36]), _packed(i[38]))
            opcodes[iid] = _str(i[2][0])  # HloInstructionProto.opcode
            if op_name and not instrs[iid][1]:
                tracing_only.add(iid)  # metadata that names only JAX's tracing (a while loop)
            ids.append(iid)

    def called_scopes(comp_ids, depth: int) -> collections.Counter:
        counts = collections.Counter()
        for cid in comp_ids:
            for iid in comps.get(cid, []):
                _, scope, _, called = instrs[iid]
                if scope:
                    counts[scope] += 1
                elif called and depth < 4:
                    counts.update(called_scopes(called, depth + 1))
        return counts

    resolved: dict[int, str] = {}

    def resolve(iid: int, depth: int = 0) -> str:
        if iid in resolved:
            return resolved[iid]
        _, scope, operands, called = instrs[iid]
        if iid in tracing_only:
            return ""
        if not scope and called:
            common = called_scopes(called, 0).most_common(1)
            scope = common[0][0] if common else ""
        if not scope and depth < 3:
            counts = collections.Counter()
            for op in operands:
                inherited = resolve(op, depth + 1) if op in instrs else ""
                if "/" in inherited:  # a model scope, not a parameter's name; drop its primitive
                    counts[inherited.rsplit("/", 1)[0]] += 1
            scope = counts.most_common(1)[0][0] if counts else ""
        if depth == 0:
            resolved[iid] = scope
        return scope

    schedules = []
    if m[7]:  # HloModuleProto.schedule -> HloScheduleProto.sequences: map<computation id, sequence>
        for entry in _message(m[7][0])[1]:
            e = _message(entry)
            if e[2]:
                seq = _packed(_message(e[2][0])[1])  # InstructionSequence.instruction_ids
                schedules.append([instrs[i][0] for i in seq if i in instrs])
    return _Module(name, {instrs[i][0]: (resolve(i), opcodes[i]) for i in instrs}, schedules,
                   {instrs[i][0]: i for i in instrs})


def _clean_scope(op_name: str) -> str:
    """'jit(_generate_core)/while/body/decode/layer_0/mlp/dot_general' -> 'decode/layer_0/mlp/dot_general'."""
    return "/".join(p for p in op_name.split("/") if p and not _NOISE.match(p))


class _CallableModule(types.ModuleType):
    def __call__(self, log_dir, **kwargs):
        return trace(log_dir, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
