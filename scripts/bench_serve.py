#!/usr/bin/env python
"""Benchmark serving under load: one JSON line per mode on stdout, the rest on stderr.

    python scripts/bench_serve.py --preset llama3-8b --max-slots 128 --max-context 4096 --requests 1000 --rate inf
    python scripts/bench_serve.py --preset llama3-8b --max-slots 128 --max-context 4096 --requests 1000 --rate 4
    python scripts/bench_serve.py --preset llama3-8b --max-slots 128 --max-context 4096 --requests 200 \
        --rate 4,8,12,16 --mode http              # a line a rate, one engine's warm-up
    python scripts/bench_serve.py --preset llama3-8b --max-slots 128 --max-context 4096 --requests 8 \
        --input-len 128 --output-len 256 --max-concurrency 1 --mode engine,http  # a lone stream
    python scripts/bench_serve.py --preset tiny --dtype float32 --requests 8 --max-slots 4 --max-context 256 \\
        --input-len 8,64 --output-len 8,32      # a CPU smoke run

A seeded workload: --requests requests, input and output lengths uniform in --input-len and
--output-len (inclusive; cut so input + output <= --max-context), random token ids, greedy,
`ignore_eos` (every request makes all its output tokens), arrivals Poisson at --rate requests/s
(inf: all at once). Weights are random of a --preset's shape, or a --model checkpoint.

Modes (--mode, a comma list, run in this order on the same requests):
  http         `jaxllm serve`'s layout: the engine in a process of its own (jaxllm.engine.process),
               its app on uvicorn (127.0.0.1) in this one, each request a streaming /v1/completions
               POST (with stream_options.include_usage) from an asyncio client in a third process;
               its tokenizer is a stand-in that writes each id as text, so every token is one SSE
               chunk; its own warm-up (the compile cache makes a second one short);
  engine       the continuous-batching engine in this process (jaxllm.Engine), no HTTP;
  http-thread  the app over that same engine, in this process: the server and the engine thread
               share one interpreter (the layout before the engine had a process of its own);
  static       `jaxllm.generate` on the requests in arrival order, batches of --max-slots rows,
               each batch to its longest output (every shape warmed up first; a request's tokens
               all come when its batch ends: its TTFT is its e2e).

JSON keys: mode, preset, model, device, dtype, git, max_slots, max_context, prefill_chunk, mixed_prefill,
requests, max_concurrency, rate, input_len, output_len, seed, warmup_s, duration_s, input_tokens,
output_tokens, request_throughput, output_tokens_per_s, ttft_ms_{p50,p90,p99}, tpot_ms_*, itl_ms_*, e2e_ms_*
(TPOT = (e2e - TTFT) / (n - 1); ITL: the gaps between a request's tokens; null in static mode), and for engine and
http: compilations_during_run, decode_steps, prefill_calls, mixed_steps (decode steps that carried a
prompt's prefill in the same pass), chunk_calls, mean_occupancy (rows
running / max_slots, mean over decode steps), mean_computed_rows (rows a decode step computed: its
decode bucket, mean over steps), and a decode step's share of the engine loop's
time: wall_ms_per_step (its busy time, idle waits left out), device_ms_per_step (what the
engine's calls take on an otherwise idle device: one iteration in --time-device-every is run
alone and timed, dispatch included; with --fake-device, its exact time), wall_over_device (the issue's host overhead at saturation:
target <= 1.10), host_ms_per_step (the loop's time outside its waits on the device),
device_wait_ms_per_step, device_timed_steps, engine_cpu_ms_per_step (the engine thread's
processor time) and process_cpu_ms_per_step (this process's: the engine, the server, XLA's
threads; in http mode the server's alone; never the HTTP client's); for http modes, http_impl
(uvicorn's HTTP layer: httptools, or h11 when httptools is not installed); errors.

After each http mode's runs, a `<mode>-disconnect` line (unless --disconnects 0): N streaming
requests, one at a time, each closing its connection after 8 tokens; free_ms_p50 and free_ms_max
(from the close until the engine's slots_in_use is 0 again), step_ms_p50 (those streams'
inter-token time), within_step_and_100ms (free_ms_max <= step_ms_p50 + 100), slots_in_use_after,
errors (a stream refused, or ended before its 8 tokens).

--fake-device MS measures the host side alone, on any machine: the engine's device programs are
replaced by ones that compute nothing (the tokens are not a model's) and whose results are ready
MS ms after the previous call's, as on a device that takes MS ms a call and never waits for the
host. The engine's bookkeeping, events and the server run as they do with a model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import math
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"must be LOW,HIGH with 1 <= LOW <= HIGH, got {text}")
    return lo, hi


def _rates(text: str) -> tuple[float, ...]:
    values = tuple(float(part) for part in text.split(","))
    if not all(value > 0 for value in values):
        raise argparse.ArgumentTypeError(f"must be rates > 0 (inf: all at once), got {text}")
    return values


MODES = ("http", "engine", "http-thread", "static")  # the order they run in


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="tiny", help="a model shape with random weights (default: tiny)")
    src.add_argument("--model", help="a checkpoint to load: HF directory or .gguf file")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default: bfloat16 on a GPU, float32 elsewhere")
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--no-mixed-prefill", dest="mixed_prefill", action="store_false",
                   help="prefill every prompt in a call of its own, never in a decode step's pass")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--rate", type=_rates, default=(math.inf,), metavar="R[,R...]",
                   help="requests per second, Poisson; a comma list runs the engine and http modes at "
                        "each rate in turn on one engine, static once (default: inf)")
    p.add_argument("--input-len", type=_pair, default=(32, 512), metavar="LOW,HIGH")
    p.add_argument("--output-len", type=_pair, default=(32, 512), metavar="LOW,HIGH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="at most N requests in flight (engine and http modes): a request that arrives "
                        "while N run is sent when one ends, its latencies from then (1: a lone stream)")
    p.add_argument("--mode", default="engine,http,static",
                   help="a comma list of engine, http, http-thread, static (default: engine,http,static)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds a mode may take (default: 3600)")
    p.add_argument("--disconnects", type=int, default=8, metavar="N",
                   help="after the http modes' runs, N streams that leave after 8 tokens, each timed until "
                        "its row is free (0: none; default: 8)")
    p.add_argument("--time-device-every", type=int, default=16, metavar="K",
                   help="time one engine iteration in K alone on the device (0: never; default: 16)")
    p.add_argument("--fake-device", type=float, default=None, metavar="MS",
                   help="programs that compute nothing, ready MS ms after the previous call's (host side alone)")
    p.add_argument("--speculate", choices=("ngram",), default=None,
                   help="the engine speculates by prompt lookup (decode buckets up to JAXLLM_SPEC_MAX_BATCH rows)")
    p.add_argument("--draft-model", metavar="PATH", default=None,
                   help="the engine speculates with this draft checkpoint (same tokenizer)")
    p.add_argument("--draft-preset", metavar="NAME", default=None,
                   help="the engine speculates with a draft of this preset's shape, random weights")
    p.add_argument("--num-speculative", type=int, default=None, metavar="K",
                   help="drafts a row a step (default: 7 for ngram, 3 for a draft)")
    args = p.parse_args(argv)
    modes = args.mode.split(",")
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--mode must be a comma list of {', '.join(MODES)}, got {args.mode}")
    args.modes = [m for m in MODES if m in modes]
    if args.requests < 1 or args.max_slots < 1 or args.max_context < 2:
        p.error("--requests and --max-slots must be >= 1, --max-context >= 2")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.time_device_every < 0 or args.disconnects < 0 or args.fake_device is not None and not args.fake_device >= 0:
        p.error("--time-device-every, --disconnects and --fake-device must be >= 0")
    drafts = [x for x in (args.speculate, args.draft_model, args.draft_preset) if x]
    if len(drafts) > 1:
        p.error("give one of --speculate, --draft-model, --draft-preset")
    if drafts and args.fake_device is not None:
        p.error("speculation needs the real device programs, not --fake-device")
    if args.num_speculative is not None and not drafts:
        p.error("--num-speculative needs --speculate ngram, --draft-model or --draft-preset")
    if args.draft_model is not None and not Path(args.draft_model).exists():
        p.error(f"--draft-model: no model at {args.draft_model!r}")
    if args.fake_device is not None and "static" in args.modes:
        p.error("--fake-device fakes the engine's programs: --mode engine, http, http-thread")
    return args


def workload(args, vocab: int, rate: float) -> list[dict]:
    """The seeded requests: prompt ids, output length, arrival time (s from the start)."""
    rng = np.random.default_rng(args.seed)
    gaps = np.zeros(args.requests) if math.isinf(rate) else rng.exponential(1 / rate, args.requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    jobs = []
    for i in range(args.requests):
        n_in = int(rng.integers(args.input_len[0], args.input_len[1] + 1))
        n_out = int(rng.integers(args.output_len[0], args.output_len[1] + 1))
        n_in = min(n_in, args.max_context - 1)
        n_out = max(1, min(n_out, args.max_context - n_in))
        jobs.append(dict(prompt=[int(t) for t in rng.integers(3, vocab, n_in)], n_out=n_out,
                         arrival=float(arrivals[i])))
    return jobs


def _percentiles(name: str, values_s) -> dict:
    v = np.asarray(values_s, np.float64) * 1e3
    return {f"{name}_ms_p{q}": (round(float(np.percentile(v, q)), 3) if v.size else None) for q in (50, 90, 99)}


def summarize(jobs, records, duration_s: float, streamed: bool = True) -> dict:
    """records[i]: (arrival time, token times) on one clock; a request's latencies from its arrival."""
    ttft, tpot, itl, e2e = [], [], [], []
    out_tokens = 0
    for (t0, times) in records:
        if not times:
            continue
        out_tokens += len(times)
        ttft.append(times[0] - t0)
        e2e.append(times[-1] - t0)
        if len(times) > 1 and streamed:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(np.diff(times))
    return dict(duration_s=round(duration_s, 3), input_tokens=sum(len(j["prompt"]) for j in jobs),
                output_tokens=out_tokens, request_throughput=round(len(e2e) / duration_s, 3),
                output_tokens_per_s=round(out_tokens / duration_s, 1),
                **_percentiles("ttft", ttft), **_percentiles("tpot", tpot), **_percentiles("itl", itl),
                **_percentiles("e2e", e2e))


def engine_fields(before: dict, after: dict, process_cpu_s: float, fake_ms: float | None = None) -> dict:
    d = {k: after[k] - before[k] for k in ("compilations", "iterations", "decode_steps", "prefill_calls",
                                            "mixed_steps", "chunk_calls", "occupied_rows", "computed_rows", "busy_s", "cpu_s", "wait_s", "device_s",
                                            "device_iterations")}
    steps = max(d["decode_steps"], 1)
    # The timed iterations' mean, over all iterations, a decode step: the device's share of a step.
    device_s = d["device_s"] / d["device_iterations"] * d["iterations"] if d["device_iterations"] else None
    if fake_ms is not None:  # a fake device's time is known exactly
        device_s = fake_ms / 1e3 * (d["decode_steps"] + d["prefill_calls"] + d["chunk_calls"] - d["mixed_steps"])
    return dict(compilations_during_run=d["compilations"], decode_steps=d["decode_steps"],
                prefill_calls=d["prefill_calls"], mixed_steps=d["mixed_steps"], chunk_calls=d["chunk_calls"],
                mean_occupancy=round(d["occupied_rows"] / steps / after["max_slots"], 4),
                mean_computed_rows=round(d["computed_rows"] / steps, 2),
                wall_ms_per_step=round(d["busy_s"] / steps * 1e3, 4),
                device_ms_per_step=None if device_s is None else round(device_s / steps * 1e3, 4),
                wall_over_device=None if not device_s else round(d["busy_s"] / device_s, 3),
                host_ms_per_step=round((d["busy_s"] - d["wait_s"]) / steps * 1e3, 4),
                device_wait_ms_per_step=round(d["wait_s"] / steps * 1e3, 4),
                device_timed_steps=d["device_iterations"],
                engine_cpu_ms_per_step=round(d["cpu_s"] / steps * 1e3, 4),
                process_cpu_ms_per_step=round(process_cpu_s / steps * 1e3, 4),
                # speculation: verify steps run, drafts checked and kept
                **{k: after[k] - before[k] for k in ("spec_steps", "spec_proposed", "spec_accepted") if k in after})


class _Late:
    """A fake program's result: its value once the fake device has finished the call."""

    def __init__(self, value, ready_at: float):
        self.value, self.ready_at = value, ready_at

    def block_until_ready(self):
        time.sleep(max(self.ready_at - time.perf_counter(), 0))
        return self

    def __array__(self, dtype=None, copy=None):  # what jax.device_get reads
        self.block_until_ready()
        return self.value


def fake_device_engine(ms: float):
    """BatchingEngine whose device programs compute nothing: each call's results are ready `ms`
    after the previous call's (the device never waits for the host; see --fake-device)."""
    import jax

    from jaxllm.engine.batching import BatchingEngine, Next

    class FakeDeviceEngine(BatchingEngine):
        def _init_state(self):
            super()._init_state()
            self._rows = self._stage = None  # no cache: the programs read none
            self._next = jax.device_get(self._next)
            V, free_at = self._params.config.vocab_size, [0.0]

            def late(x):
                free_at[0] = max(free_at[0], time.perf_counter()) + ms / 1e3
                return _Late(x, free_at[0])

            def logprobs(n):
                return np.zeros((n,), np.float32), np.zeros((n, 20), np.float32), np.zeros((n, 20), np.int32)

            def into(nxt, at, first):
                keep = at < len(nxt.tokens)
                tokens, index = nxt.tokens.copy(), nxt.index.copy()
                tokens[at[keep]], index[at[keep]] = first[keep], 1
                return Next(tokens, index, nxt.sampling)

            def decode(params, rows, nxt, active, rotation, *, flags, logprobs_):
                tokens = (nxt.tokens * 7 + 3) % V
                return rows, Next(tokens, nxt.index + 1, nxt.sampling), late(tokens), \
                    logprobs(len(tokens)) if logprobs_ else None

            def prefill(params, rows, nxt, tokens_bW, start_b, at_b, sampling_b, draft=None):
                first = np.asarray(tokens_bW)[:, -1].copy()
                return rows, into(nxt, np.asarray(at_b), first), late(first), logprobs(len(first))

            def mixed(params, rows, nxt, active, rotation, tokens_bW, start_b, at_b, sampling_b, draft=None, *,
                      flags):
                rows, nxt, tokens, _ = decode(params, rows, nxt, active, rotation, flags=flags, logprobs_=False)
                first = np.asarray(tokens_bW)[:, -1].copy()
                return rows, into(nxt, np.asarray(at_b), first), tokens, _Late(first, tokens.ready_at), \
                    logprobs(len(first))

            def chunk(params, stage, tokens_1C, start_1, draft=None):
                return late(None)  # the staging cache: what a timed iteration waits for

            def chunk_insert(params, rows, nxt, stage, tokens_1C, at, sampling_1, draft=None):
                first = np.asarray(tokens_1C)[:, -1].copy()
                return rows, into(nxt, np.reshape(at, (1,)), first), late(first), logprobs(1)

            self._decode_fn = lambda *a, flags, logprobs: decode(*a, flags=flags, logprobs_=logprobs)
            self._prefill_fn, self._chunk_insert_fn, self._mixed_fn = prefill, chunk_insert, mixed
            self._chunk_fns = {True: chunk, False: chunk}

    return FakeDeviceEngine


def run_engine(engine, jobs, timeout: float, concurrency: int | None = None):
    """Submit each job at its arrival time from this thread (and, with `concurrency`, once fewer
    than that many run); tokens timed in on_event."""
    from jaxllm.engine.api import Request

    records = [(0.0, []) for _ in jobs]
    done = threading.Semaphore(0)
    slots = threading.Semaphore(concurrency or len(jobs))
    errors = []

    def listener(i):
        def on_event(event):
            now = time.perf_counter()
            records[i][1].extend([now] * len(event.token_ids))
            if event.finish_reason is not None:
                if event.finish_reason not in ("length", "stop"):
                    errors.append(f"request {i}: {event.finish_reason} {event.error or ''}")
                slots.release()
                done.release()
        return on_event

    start = time.perf_counter()
    deadline = start + timeout
    for i, job in enumerate(jobs):
        wait = start + job["arrival"] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        if not slots.acquire(timeout=max(deadline - time.perf_counter(), 0)):
            errors.append("timed out")
            return records, time.perf_counter() - start, errors
        records[i] = (time.perf_counter(), [])
        engine.submit(Request(tuple(job["prompt"]), job["n_out"], ignore_eos=True), listener(i))
    for _ in jobs:
        if not done.acquire(timeout=max(deadline - time.perf_counter(), 0)):
            errors.append("timed out")
            break
    return records, time.perf_counter() - start, errors


class IdTokenizer:
    """A stand-in tokenizer for random weights: each id is the text ' <id>'."""

    chat_template = None
    eos_token_ids = ()

    def __init__(self, vocab: int):
        self.vocab_size = vocab

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {int(i)}" for i in ids)

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in text.split()]


async def _stream(port: int, body: bytes, times: list, usage: dict, leave_after: int | None = None) -> int:
    """POST a streaming completion over a raw HTTP/1.1 connection; time every SSE chunk with text.
    With `leave_after`, close the connection once that many have come (a client that goes away)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        key, _, value = line.decode().partition(":")
        headers[key.strip().lower()] = value.strip()
    chunked = headers.get("transfer-encoding", "").lower() == "chunked"
    buffer = b""
    while True:
        if chunked:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            data = await reader.readexactly(size)
            await reader.readexactly(2)
        else:
            data = await reader.read(1 << 16)
            if not data:
                break
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            payload = event.decode().removeprefix("data: ").strip()
            if payload == "[DONE]" or not payload:
                continue
            message = json.loads(payload)
            if message.get("usage"):
                usage.update(message["usage"])
            if any(c.get("text") for c in message.get("choices", [])):
                times.append(time.perf_counter())
        if leave_after is not None and len(times) >= leave_after:
            break
    writer.close()
    return status


def _raise_open_files() -> None:
    """Each request holds a socket in the client and one in the server: the soft limit on open
    files (often 1024) up to the hard one."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def http_client(port: int, jobs, timeout: float, concurrency: int | None = None):
    """Send every job at its arrival time (and, with `concurrency`, once fewer than that many are in
    flight) as a streaming completion; (records, duration, errors)."""

    async def client():
        records = [(0.0, []) for _ in jobs]
        errors = []
        slots = asyncio.Semaphore(concurrency or len(jobs))
        start = time.perf_counter()

        async def one(i, job):
            await asyncio.sleep(max(start + job["arrival"] - time.perf_counter(), 0))
            async with slots:
                await send(i, job)

        async def send(i, job):
            times, usage = [], {}
            records[i] = (time.perf_counter(), times)
            body = json.dumps(dict(model="bench", prompt=job["prompt"], max_tokens=job["n_out"], temperature=0,
                                   ignore_eos=True, stream=True, stream_options=dict(include_usage=True)))
            try:
                status = await _stream(port, body.encode(), times, usage)
                if status != 200 or usage.get("completion_tokens") != job["n_out"]:
                    errors.append(f"request {i}: HTTP {status}, usage {usage}")
            except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                errors.append(f"request {i}: {type(e).__name__}: {e}")
        try:
            await asyncio.wait_for(asyncio.gather(*(one(i, j) for i, j in enumerate(jobs))), timeout)
        except asyncio.TimeoutError:
            errors.append("timed out")
        return records, time.perf_counter() - start, errors

    _raise_open_files()
    return asyncio.run(client())


@contextlib.contextmanager
def http_server(engine, vocab: int):
    """The port of `jaxllm serve`'s app on uvicorn over `engine` (started), until the block ends
    (which shuts the engine down)."""
    import uvicorn

    _raise_open_files()

    from jaxllm.server.app import create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(engine, IdTokenizer(vocab), "bench", start_engine=False, max_n=1)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=60,
                                           limit_concurrency=None, backlog=4096))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.05)

    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(60)


LEAVE_AFTER = 8  # tokens a --disconnects stream reads before it closes its connection


def probe_disconnects(port: int, engine, args, vocab: int) -> dict:
    """--disconnects streams, one at a time on an idle engine: each reads 8 tokens, closes its
    connection, and is timed until the engine's slots in use are back to 0 (issue 58: within one
    step + 100 ms). The step is the stream's own inter-token time."""
    def until_free(limit_s: float = 30) -> float:
        begun = time.perf_counter()
        while engine.stats()["slots_in_use"] and time.perf_counter() - begun < limit_s:
            time.sleep(0.0005)
        return time.perf_counter() - begun

    rng = np.random.default_rng(args.seed + 1)
    free_ms, itl, errors = [], [], []
    for i in range(args.disconnects):
        until_free()  # what the run left (a run that timed out) is not this stream's
        prompt = [int(t) for t in rng.integers(3, vocab, max(1, min(16, args.max_context // 4)))]
        body = json.dumps(dict(model="bench", prompt=prompt, max_tokens=min(512, args.max_context - len(prompt)),
                               temperature=0, ignore_eos=True, stream=True)).encode()
        times = []
        status = asyncio.run(_stream(port, body, times, {}, leave_after=LEAVE_AFTER))
        free_ms.append(until_free() * 1e3)
        if status != 200 or len(times) < LEAVE_AFTER:
            errors.append(f"stream {i}: HTTP {status}, {len(times)} tokens before leaving")
        itl.extend(np.diff(times) * 1e3)
    step = float(np.median(itl)) if itl else None
    return dict(disconnects=args.disconnects, free_ms_p50=round(float(np.median(free_ms)), 3),
                free_ms_max=round(max(free_ms), 3), step_ms_p50=None if step is None else round(step, 3),
                within_step_and_100ms=None if step is None else max(free_ms) <= step + 100,
                slots_in_use_after=engine.stats()["slots_in_use"], errors=errors[:5])


def run_http(port: int, jobs, timeout: float, concurrency: int | None = None):
    # The client runs in a process of its own, as a user's would: parsing every stream's chunks
    # here would take the interpreter lock from the engine thread and the server.
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(http_client, port, jobs, timeout, concurrency).result()


def run_static(params, jobs, batch: int):
    """generate over the jobs in arrival order, `batch` rows at a time; each row's tokens at the end
    of its batch. Every batch shape runs once untimed first (compilation)."""
    import jaxllm

    groups = [jobs[i:i + batch] for i in range(0, len(jobs), batch)]

    def call(group):
        out = jaxllm.generate(params, [j["prompt"] for j in group], max_new_tokens=max(j["n_out"] for j in group),
                              eos_token_ids=[])
        out.tokens.block_until_ready()

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one compilation a shape is this mode's expected cost
        seen = set()
        for group in groups:
            shape = (len(group), jaxllm.engine.generate.bucket(max(len(j["prompt"]) for j in group)),
                     jaxllm.engine.generate.bucket(max(j["n_out"] for j in group)))
            if shape not in seen:
                seen.add(shape)
                call(group)
        start = time.perf_counter()
        records = []
        for group in groups:
            arrived = max(start + j["arrival"] for j in group)  # a batch starts when its last row came
            wait = arrived - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            call(group)
            now = time.perf_counter()
            records.extend((start + j["arrival"], [now] * j["n_out"]) for j in group)
    return records, time.perf_counter() - start, []


def _git() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _params(args, dtype: str):
    """The target's params: random of --preset's shape (seeded), or --model's."""
    import jax

    import jaxllm
    from jaxllm.tools import presets

    if args.model:
        return jaxllm.load(args.model, dtype=dtype)
    return presets.random_params(presets.get_config(args.preset), seed=args.seed, dtype=jax.numpy.dtype(dtype))


def bench_engine(args, params=None):
    """The engine the engine and http modes run (built in the process that runs it: params are not
    sent between processes)."""
    import jax

    import jaxllm
    from jaxllm.engine.batching import BatchingEngine
    from jaxllm.tools import presets

    dtype = _dtype(args, jax.default_backend())
    params = params if params is not None else _params(args, dtype)
    speculative = args.speculate
    if args.draft_model:
        speculative = jaxllm.load(args.draft_model, dtype=dtype)
    elif args.draft_preset:
        speculative = presets.random_params(presets.get_config(args.draft_preset), seed=args.seed + 1,
                                            dtype=jax.numpy.dtype(dtype))
    kind = BatchingEngine if args.fake_device is None else fake_device_engine(args.fake_device)
    return kind(params, max_slots=args.max_slots, max_context=args.max_context, max_queued=args.requests,
                prefill_chunk=args.prefill_chunk, mixed_prefill=args.mixed_prefill,
                time_device_every=args.time_device_every,
                **(dict(speculative=speculative, num_speculative=args.num_speculative)
                   if speculative is not None else {}))


def _dtype(args, platform: str) -> str:
    """--dtype, or the default on JAX's `platform`."""
    return args.dtype or ("bfloat16" if platform == "gpu" else "float32")


def _vocab(args) -> int:
    """The range of the workload's token ids, known without touching a device."""
    if args.model:
        import jaxllm
        return jaxllm.load_tokenizer(args.model).vocab_size
    from jaxllm.tools import presets
    return presets.get_config(args.preset).vocab_size


def main(argv=None) -> int:
    args = parse_args(argv)
    from functools import partial

    from jaxllm.engine.process import ProcessEngine

    vocab = _vocab(args)
    label = dict(preset=None if args.model else args.preset, model=args.model, device=None,
                 dtype=args.dtype, git=_git(), max_slots=args.max_slots, max_context=args.max_context,
                 prefill_chunk=args.prefill_chunk, mixed_prefill=args.mixed_prefill, requests=args.requests,
                 max_concurrency=args.max_concurrency,
                 input_len=list(args.input_len),
                 output_len=list(args.output_len), seed=args.seed, fake_device_ms=args.fake_device,
                 speculate=args.speculate or args.draft_model or args.draft_preset,
                 num_speculative=args.num_speculative)
    engine = None

    def started(e) -> None:
        e.on_progress = lambda message: log(f"engine: {message}")
        begun = time.perf_counter()
        e.start()
        label["warmup_s"] = round(time.perf_counter() - begun, 2)
        log(f"engine ready in {label['warmup_s']} s, {e.stats()['compilations']} compilations")

    def emit(mode, rate, jobs, result, before, cpu):
        records, duration, errors = result
        label["rate"] = None if math.isinf(rate) else rate
        line = dict(mode=mode, **label, **summarize(jobs, records, duration, streamed=mode != "static"))
        if mode != "static":
            line.update(engine_fields(before, engine.stats(), time.process_time() - cpu, args.fake_device))
        if mode.startswith("http"):  # uvicorn's HTTP layer: httptools when installed, else h11 (pure Python, slower)
            line["http_impl"] = "httptools" if importlib.util.find_spec("httptools") else "h11"
        line["errors"] = errors[:5] + ([f"... {len(errors) - 5} more"] if len(errors) > 5 else [])
        print(json.dumps(line), flush=True)

    def each_rate(mode, run):
        for rate in args.rate:
            jobs = workload(args, vocab, rate)
            log(f"{mode}: {len(jobs)} requests, rate {rate}")
            before, cpu = engine.stats(), time.process_time()
            emit(mode, rate, jobs, run(jobs), before, cpu)

    def disconnects(mode, port):
        if args.disconnects:
            log(f"{mode}: {args.disconnects} streams that leave after {LEAVE_AFTER} tokens")
            line = dict(mode=f"{mode}-disconnect", **label, **probe_disconnects(port, engine, args, vocab))
            print(json.dumps(line), flush=True)

    # http first, as `jaxllm serve` runs: the engine in a process of its own, which gets the whole
    # device while this process has not touched it; then every rate in engine mode and http-thread
    # mode (one engine, in this process), then static once (on the first rate's requests: static
    # mode ignores arrival times)
    if "http" in args.modes:
        engine = ProcessEngine(partial(bench_engine, args), max_queued=args.requests)
        started(engine)
        label["device"] = engine.info["device"]
        label["dtype"] = _dtype(args, engine.info["platform"])
        with http_server(engine, vocab) as port:  # which shuts the engine down at its end
            each_rate("http", lambda jobs: run_http(port, jobs, args.timeout, args.max_concurrency))
            disconnects("http", port)
        engine = None
    if not {"engine", "http-thread", "static"} & set(args.modes):
        return 0
    import jax
    label["dtype"] = _dtype(args, jax.default_backend())
    label["device"] = str(jax.devices()[0])
    params = _params(args, label["dtype"])
    if {"engine", "http-thread"} & set(args.modes):
        engine = bench_engine(args, params)
        started(engine)
    if "engine" in args.modes:
        each_rate("engine", lambda jobs: run_engine(engine, jobs, args.timeout, args.max_concurrency))
    if "http-thread" in args.modes:
        with http_server(engine, vocab) as port:  # which shuts the engine down at its end
            each_rate("http-thread", lambda jobs: run_http(port, jobs, args.timeout, args.max_concurrency))
            disconnects("http-thread", port)
        engine = None
    if "static" in args.modes:
        if engine is not None:  # its cache goes before generate's batches need the memory
            engine.shutdown(10)
            engine = None
            gc.collect()
        jobs = workload(args, vocab, args.rate[0])
        log(f"static: {len(jobs)} requests")
        emit("static", args.rate[0], jobs, run_static(params, jobs, args.max_slots), None, None)
    if engine is not None:
        engine.shutdown(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
