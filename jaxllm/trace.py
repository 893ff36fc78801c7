"""Profiler traces a user can read, a text summary of them, and a warning on surprise recompiles.

`trace(dir)` records a `jax.profiler` trace of the work inside it. The run lands in
`dir/plugins/profile/<timestamp>/`: `*.xplane.pb` (TensorBoard / XProf), `*.trace.json.gz` (Chrome
trace events) and `perfetto_trace.json.gz` (ui.perfetto.dev). Trace steady-state work: compile and
warm up before entering, or let `trace_steady` do it. `summarize(dir)` reads the trace back: the
top XLA ops by device time (on CPU, by the host threads that run them) with their share, and the
share of each named scope of the model (prefill/decode, layer_i, attention, mlp, moe, lm_head,
sampling). The scopes come from the HLO the profiler stores in the xplane file, whose op metadata
carries the `jax.named_scope` path of every instruction.

`compile_count` / `check_recompile` are the hook around calls of jitted entry points: the first
compilation of a function for a model is expected, each later new shape gets one
`RecompileWarning` naming it.

The module is callable: `jaxllm.trace(dir)` is `jaxllm.trace.trace(dir)`, so the context manager
and the module's other names (`jaxllm.trace.summarize`) live under one name without shadowing.
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
import threading
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, NamedTuple

import jax

# ----------------------------------------------------------------------------------------------
# Taking a trace


def profile_options(detail: bool = False) -> jax.profiler.ProfileOptions:
    """Profiler options: lean by default; `detail` adds Python call stacks and verbose host events.

    Device kernels are always recorded one by one: XLA runs its command buffers (CUDA graphs)
    kernel by kernel while a profiler is attached, unless the process was started with
    `--xla_enable_command_buffers_during_profiling=true`; see `docs/tracing.md`.
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
        lines.append(f"  XProf:    xprof --logdir {self.log_dir}   (or tensorboard --logdir {self.log_dir} "
                     "with tensorboard-plugin-profile), then the URL it prints, Profile tab")
        return "\n".join(lines)


@contextlib.contextmanager
def trace(log_dir: str | os.PathLike, *, detail: bool = False, perfetto: bool = True) -> Iterator[Trace]:
    """Record a profiler trace of the block into `log_dir` (viewable in Perfetto and XProf).

    Warm up (compile) before entering: compilation inside the block is traced too and swamps the
    steady state. Block on the results inside (`jax.block_until_ready`): work still queued when the
    block exits is cut off. `detail=True` adds Python call stacks and verbose host events.
    """
    info = Trace(Path(log_dir), detail=detail)
    info.log_dir.mkdir(parents=True, exist_ok=True)
    before = set(_run_dirs(info.log_dir))
    jax.profiler.start_trace(str(info.log_dir), create_perfetto_trace=perfetto,
                             profiler_options=profile_options(detail))
    try:
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
    if warmup < 1:
        warnings.warn("trace_steady(warmup=0): compilation will be part of the trace", stacklevel=2)
    for _ in range(warmup):
        jax.block_until_ready(fn())
    with trace(log_dir, detail=detail) as info:
        for _ in range(runs):
            info.output = jax.block_until_ready(fn())
    return info


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

    `scopes` maps a scope name (prefill, decode, attention, mlp, moe, lm_head, sampling, layer_i,
    and "other" per grouping) to its share of all op time.
    """

    def __init__(self, ops, *, total_s: float, scopes: dict[str, float], layers: dict[str, float],
                 source: str, device: bool):
        super().__init__(ops)
        self.total_s = total_s
        self.scopes = scopes
        self.layers = layers
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
        return "\n".join(out)


PHASES = ("prefill", "decode")
BLOCKS = ("attention", "mlp", "moe", "router", "experts", "lm_head", "sampling")
_LAYER = re.compile(r"layer_\d+$")
_CONTAINERS = {"while", "conditional", "call", "async-start", "async-done"}
_CONTAINER_NAME = re.compile(r"^(while|conditional|call)\b", re.IGNORECASE)
# Components of an op_name path that say how JAX traced it, not where in the model it is.
_NOISE = re.compile(r"^(jit|pjit|jvp|transpose|vmap|remat|checkpoint|shard_map|custom_jvp_call|"
                    r"custom_vjp_call)\(.*\)$|^(while|body|cond|branch_\d+|closed_call|core_call)$")


def summarize(trace_dir: str | os.PathLike, top: int | None = 15) -> Summary:
    """The `top` ops (None: all) by device time in the latest trace under `trace_dir`, with shares.

    `trace_dir` is the directory given to `trace` (its newest run is read), a run directory, or a
    `.trace.json.gz` file. Shares are of the time of all ops. An op's time excludes ops nested in
    it, and loops and calls are left out: their bodies' ops are counted instead.
    """
    run_dir, json_files = _trace_files(Path(trace_dir))
    hlo = _hlo_scopes(run_dir)
    times: dict[tuple[str, str], float] = collections.defaultdict(float)
    device = False
    for f in json_files:
        with gzip.open(f, "rt") as fh:
            events = json.load(fh).get("traceEvents", [])
        t, on_device = _op_times(events)
        device |= on_device
        for key, secs in t.items():
            scope, opcode = hlo.get(key[0], {}).get(key[1], ("", ""))
            if opcode in _CONTAINERS or (not opcode and _CONTAINER_NAME.match(key[1])):
                continue
            times[key] += secs
    total = sum(times.values())
    if total <= 0:
        raise ValueError(f"no XLA op events in the trace at {trace_dir}: was anything run inside it?")
    scoped: dict[str, float] = collections.defaultdict(float)
    layers: dict[str, float] = collections.defaultdict(float)
    rows = []
    for (module, op), secs in times.items():
        scope = hlo.get(module, {}).get(op, ("", ""))[0]
        parts = scope.split("/") if scope else []
        scoped[next((p for p in parts if p in PHASES), "other phase")] += secs / total
        scoped[next((p for p in reversed(parts) if p in BLOCKS), "other block")] += secs / total
        layer = next((p for p in parts if _LAYER.match(p)), None)
        if layer:
            layers[layer] += secs / total
        rows.append(OpTime(op, secs, secs / total, scope))
    rows.sort(key=lambda r: -r.seconds)
    return Summary(rows if top is None else rows[:top], total_s=total, scopes=dict(scoped),
                   layers=dict(layers), source=str(json_files[0].parent), device=device)


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def _trace_files(path: Path) -> tuple[Path | None, list[Path]]:
    if path.is_file():
        return path.parent, [path]
    run = path
    runs = _run_dirs(path)
    if runs:
        run = max(runs, key=lambda p: p.stat().st_mtime)
    # One trace.json.gz per host; perfetto_trace.json.gz holds the same events again.
    files = sorted(f for f in run.glob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {path}: not a jaxllm.trace directory")
    return run, files


def _op_times(events: list[dict]) -> tuple[dict[tuple[str, str], float], bool]:
    """Own time (seconds) of each (hlo module, op) in Chrome trace events; and whether on a device."""
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device_pids = {pid for pid, name in procs.items() if name.startswith("/device:")}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if device_pids:
        # Kernels and copies sit on the stream lines; other lines of a device (XLA Ops, XLA
        # Modules, name scopes, steps) are derived from them and would count them again.
        def keep(e):
            return e["pid"] in device_pids and threads.get((e["pid"], e.get("tid")), "").startswith("Stream")
    else:
        def keep(e):  # CPU: XLA's thunks run on host threads, each event names its HLO op
            return "hlo_op" in e.get("args", {})
    chosen = [e for e in complete if keep(e)]
    if device_pids and not chosen:
        def keep(e):
            return e["pid"] in device_pids
        chosen = [e for e in complete if keep(e)]
    times: dict[tuple[str, str], float] = collections.defaultdict(float)
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
                times[_op_key(done)] += own
            if stack:  # nested: its time is not its parent's own time
                stack[-1][2] -= min(end, stack[-1][0]) - start
            stack.append([end, e, e["dur"]])
        for _, done, own in stack:
            times[_op_key(done)] += own
    # Chrome trace events are in microseconds.
    return {k: max(v, 0.0) * 1e-6 for k, v in times.items()}, bool(device_pids)


def _op_key(e: dict) -> tuple[str, str]:
    args = e.get("args", {})
    return args.get("hlo_module", ""), args.get("hlo_op") or e["name"]


# --- the HLO stored in the xplane file: instruction name -> named-scope path --------------------
# A minimal protobuf reader: the XSpace proto (tsl/profiler/protobuf/xplane.proto) and HloProto
# (xla/service/hlo.proto) field numbers below are stable parts of the on-disk format.


def _hlo_scopes(run_dir: Path) -> dict[str, dict[str, tuple[str, str]]]:
    """{hlo module name: {instruction name: (scope path, opcode)}} from the run's `*.xplane.pb`."""
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for f in sorted(run_dir.glob("*.xplane.pb")):
        try:
            for module_proto in _hlo_protos(memoryview(f.read_bytes())):
                name, scopes = _module_scopes(module_proto)
                out.setdefault(name, {}).update(scopes)
        except (ValueError, IndexError, UnicodeDecodeError):
            continue  # a format we cannot read: ops are still listed, only without scopes
    return out


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


def _hlo_protos(xspace) -> Iterator[Any]:
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


def _packed(values) -> list[int]:
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


def _module_scopes(module_proto) -> tuple[str, dict[str, tuple[str, str]]]:
    """(module name, {instruction: (scope, opcode)}) of an HloModuleProto.

    Backend passes drop the metadata of some instructions (CPU dot fusions, library calls). Such
    an instruction takes the most common scope of the instructions it calls, else the scope
    (without its final primitive) of its operands: a dot lives in the block of its input.
    """
    m = _message(module_proto)
    name = _str(m[1][0])  # HloModuleProto.name
    comps: dict[int, list[int]] = {}  # computation id -> instruction ids
    instrs: dict[int, tuple[str, str, list[int], list[int]]] = {}  # id -> (name, scope, operands, called)
    opcodes: dict[int, str] = {}
    plain: set[int] = set()
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
                plain.add(iid)  # metadata that names only JAX's tracing (a while loop): no fallback
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
        if iid in plain:
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

    return name, {instrs[iid][0]: (resolve(iid), opcodes[iid]) for iid in instrs}


def _clean_scope(op_name: str) -> str:
    """'jit(_generate_core)/while/body/decode/layer_0/mlp/dot_general' -> 'decode/layer_0/mlp/dot_general'."""
    return "/".join(p for p in op_name.split("/") if p and not _NOISE.match(p))


# ----------------------------------------------------------------------------------------------
# Recompilation warnings


class RecompileWarning(UserWarning):
    """A jitted jaxllm function compiled again for a new shape in this process."""


_lock = threading.Lock()
_shapes: dict[tuple[str, Hashable], list[str]] = {}


def compile_count(fn) -> int | None:
    """How many compiled versions jitted `fn` holds now (None if this JAX cannot tell)."""
    size = getattr(fn, "_cache_size", None)
    try:
        return size() if size is not None else None
    except Exception:
        return None


def check_recompile(fn, before: int | None, name: str, describe: Callable[[], str],
                    group: Hashable = None) -> bool:
    """After a call of jitted `fn`: if it compiled (its count grew past `before`), note the shape.

    The hook around a jitted entry point, in two lines:
        n = compile_count(_core); out = _core(...); check_recompile(_core, n, "generate", ...)
    `group` keeps the first compilation of each model quiet (pass the config and dtype);
    `describe()` names the shape, e.g. "batch 1, prompt bucket 64, cache 128". Returns whether it
    warned.
    """
    after = compile_count(fn)
    if before is None or after is None or after <= before:
        return False
    return note_compile(name, describe(), group, stacklevel=4)  # warn at the jaxllm caller's caller


def note_compile(name: str, shape: str, group: Hashable = None, *, stacklevel: int = 2) -> bool:
    """Record that `name` compiled for `shape`; warn once if it had compiled for another shape."""
    with _lock:
        seen = _shapes.setdefault((name, group), [])
        if shape in seen:
            return False
        seen.append(shape)
        if len(seen) == 1:
            return False
        before = seen[-2]
    warnings.warn(
        f"jaxllm: recompiling {name} for {shape} (new shape; compiled before for {before}). "
        "Each new shape costs a compilation: keep prompt lengths, batch sizes and "
        "max_new_tokens within few buckets.", RecompileWarning, stacklevel=stacklevel)
    return True


def shape_text(batch: int, prompt_bucket: int, cache_length: int, steps: int | None = None,
               sampling=None) -> str:
    """'batch 1, prompt bucket 64, 64 new-token steps, cache 128, greedy': what a compile keys on."""
    parts = [f"batch {batch}", f"prompt bucket {prompt_bucket}"]
    if steps is not None:
        parts.append(f"{steps} new-token steps")
    parts.append(f"cache {cache_length}")
    if sampling is not None:  # a SamplingConfig: static() is (greedy, top_k, top_p, min_p, penalty)
        greedy, *on = sampling.static()
        used = [n for n, o in zip(("top_k", "top_p", "min_p", "repetition penalty"), on) if o]
        parts.append(("greedy" if greedy else "sampling") + (" with " + ", ".join(used) if used else ""))
    return ", ".join(parts)


def compiled_shapes(name: str, group: Hashable = None) -> list[str]:
    """The shapes `name` has compiled for in this process, in order."""
    with _lock:
        return list(_shapes.get((name, group), []))


class _CallableModule(types.ModuleType):
    def __call__(self, log_dir, **kwargs):
        return trace(log_dir, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
