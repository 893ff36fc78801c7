"""`jaxllm serve`'s app on a real uvicorn server on 127.0.0.1, driven by the official openai client.

One server per module (a tiny random float32 Llama with the default model's tokenizer, vocab
49152), every wait bounded. Greedy answers must equal `jaxllm.generate` for the same prompt.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import uvicorn

import jaxllm
from jaxllm.model.config import ModelConfig

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*recompiling generate")]

KEY = "sk-test-key"
MODEL = "tiny"
MAX_CONTEXT = 128
MAX_QUEUED = 4
MAX_SLOTS = 2


class LiveServer:
    def __init__(self, app):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[sock]), daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread ended")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def request(self, method: str, path: str, body: bytes | None = None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read(), dict(r.getheaders())
        finally:
            conn.close()

    def get(self, path: str):
        return self.request("GET", path)

    def post(self, path: str, data, key: str | None = KEY):
        body = data if isinstance(data, bytes) else json.dumps(data).encode()
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return self.request("POST", path, body, headers)

    def metrics(self) -> dict[str, float]:
        status, text, _ = self.get("/metrics")
        assert status == 200
        out = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if m["jaxllm:num_requests_running"] == 0 and m["jaxllm:num_requests_waiting"] == 0:
                return m
            time.sleep(0.05)
        raise TimeoutError(f"requests still on the engine: {m}")


def _tiny_params():
    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, ffn_size=128, max_position_embeddings=512,
                      eos_token_ids=(2,))
    # large weights: logits far apart, so greedy picks have clear margins
    return jaxllm.init_params(cfg, jax.random.key(0), dtype=jnp.float32, scale=0.3)


@pytest.fixture(scope="module")
def tok():
    return jaxllm.load_tokenizer()


@pytest.fixture(scope="module")
def params():
    return _tiny_params()


@pytest.fixture(scope="module")
def live(params, tok):
    from jaxllm.engine.batching import BatchingEngine
    from jaxllm.server.app import create_app

    engine = BatchingEngine(params, eos_token_ids=tok.eos_token_ids, max_slots=MAX_SLOTS, max_context=MAX_CONTEXT,
                            max_queued=MAX_QUEUED, prefill_chunk=64)
    server = LiveServer(create_app(engine, tok, MODEL, api_key=KEY, eos_token_ids=tok.eos_token_ids))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{live.port}/v1", api_key=KEY, max_retries=0, timeout=60)


def _greedy(params, ids, n):
    out = jaxllm.generate(params, [ids], max_new_tokens=n, eos_token_ids=[])
    return [int(t) for t in np.asarray(out.tokens[0])]


PROMPT = "The capital of France is"


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_greedy_equals_generate_with_exact_usage(client, params, tok):
    ids = tok.encode(PROMPT, add_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text == tok.decode(_greedy(params, ids, 10), True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 10, len(ids) + 10)


def test_completion_stream_equals_non_stream_and_ends_with_usage(client, live):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    body = chunks[:-1]
    assert "".join(c.choices[0].text for c in body) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    # without include_usage: no usage chunk; the raw stream ends with [DONE]
    status, raw, headers = live.post("/v1/completions", dict(kw["extra_body"], **{k: v for k, v in kw.items()
                                                                                 if k != "extra_body"}, stream=True))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert all(json.loads(e[6:])["choices"] for e in events[:-1])


def test_chat_greedy_stream_and_role(client, params, tok):
    messages = [{"role": "user", "content": "Say hello."}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == tok.decode(_greedy(params, ids, 8), True)
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    # max_completion_tokens wins over max_tokens
    r = client.chat.completions.create(max_completion_tokens=3, **kw)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_n_choices_and_seed_reproducibility(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=1234,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each choice draws with its own seed
    assert a.usage.completion_tokens == 18
    other = client.completions.create(**dict(kw, seed=99))
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    # streamed n=3: one finish_reason per choice, the same texts
    texts, finishes = ["", "", ""], [[], [], []]
    for c in client.completions.create(stream=True, **kw):
        ch = c.choices[0]
        texts[ch.index] += ch.text
        if ch.finish_reason:
            finishes[ch.index].append(ch.finish_reason)
    assert texts == [c.text for c in a.choices] and finishes == [["length"]] * 3


def _cut(text: str, stops: list[str]) -> str:
    """The text before the stop string that completes first, character by character."""
    for end in range(1, len(text) + 1):
        for s in stops:
            if text[:end].endswith(s):
                return text[:end - len(s)]
    return text


def test_stop_strings(client, live, tok, params):
    ids = tok.encode(PROMPT, add_special_tokens=True)
    out = _greedy(params, ids, 12)
    text = tok.decode(out, True)
    bounds = [len(tok.decode(out[:k], True)) for k in range(13)]
    multi = text[bounds[2] - 1:bounds[5]]  # spans tokens 2..5
    first = text[:1]
    overlap = [text[bounds[3]:bounds[3] + 4], text[bounds[3] + 2:bounds[3] + 5]]
    before = live.metrics()
    for stops in ([multi], [first], overlap, ["never-in-output", multi]):
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stops,
                  extra_body={"ignore_eos": True})
        want = _cut(text, stops)
        r = client.completions.create(**kw)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
        # the tokens up to the one that completed the stop string
        assert r.usage.completion_tokens == next(k for k in range(1, 13)
                                                 if any(x in tok.decode(out[:k], True) for x in stops))
        pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
        assert "".join(pieces) == want  # nothing of a stop string reached the stream
    after = live.wait_idle()
    assert after["jaxllm:request_success_total{finished_reason=\"stop\"}"] >= \
        before.get("jaxllm:request_success_total{finished_reason=\"stop\"}", 0) + 8


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    assert "".join(e.token for e in content) == r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


def _error(status_body) -> dict:
    status, body, headers = status_body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return status, err, headers


def test_auth(live, client):
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for key in (None, "wrong"):
        status, err, _ = _error(live.post("/v1/completions", {"model": MODEL, "prompt": "x"}, key=key))
        assert status == 401 and err["code"] == "invalid_api_key"
    assert live.get("/health")[0] == 200  # open without a key


def test_bad_requests_are_openai_400s(live, client):
    for body, param in [(b"{not json", "body"),
                        ({"model": MODEL}, "prompt"),
                        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
                        ({"model": MODEL, "prompt": "x", "temperature": 5}, "temperature"),
                        ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
                        ({"model": MODEL, "prompt": "x", "suffix": "tail"}, "suffix"),
                        ({"model": MODEL, "prompt": "x", "echo": True}, "echo"),
                        ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
                        ({"model": MODEL, "prompt": "x", "n": 100}, "n"),
                        ({"model": MODEL, "prompt": "x " * 200}, "prompt"),
                        ({"model": MODEL, "prompt": "x", "max_tokens": MAX_CONTEXT}, "max_tokens")]:
        status, err, _ = _error(live.post("/v1/completions", body))
        assert status == 400 and err["param"] == param, (body, err)
        assert err["type"] == "invalid_request_error"
    for extra, param in [({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                         ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
                         ({"messages": []}, "messages")]:
        body = dict({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, **extra)
        status, err, _ = _error(live.post("/v1/chat/completions", body))
        assert status == 400 and err["param"] == param, (extra, err)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", extra_body={"suffix": "y"})
    # unknown fields are ignored
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"no_such_field": 1})
    assert r.usage.completion_tokens == 1


def test_unknown_model_is_404(live, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    status, err, _ = _error(live.post("/v1/chat/completions", {"model": "gpt-4", "messages": [
        {"role": "user", "content": "hi"}]}))
    assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model"


def test_full_queue_is_429_with_retry_after(live, client):
    before = live.metrics()["jaxllm:requests_rejected_total"]
    # n choices are n engine requests: more than MAX_SLOTS running plus MAX_QUEUED waiting cannot fit
    status, err, headers = _error(live.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                                 "n": MAX_SLOTS + MAX_QUEUED + 1}))
    assert status == 429 and int(headers["retry-after"]) >= 1
    assert live.wait_idle()["jaxllm:requests_rejected_total"] == before + 1
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"  # nothing else failed


def _leave_while_queued(live, body: dict) -> None:
    """Send a request over a raw socket, wait until it queues, then close the connection."""
    before = live.metrics()["jaxllm:num_requests_waiting"]
    conn = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    data = json.dumps(body).encode()
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(data)).encode() +
                 b"\r\n\r\n" + data)
    deadline = time.monotonic() + 10
    while live.metrics()["jaxllm:num_requests_waiting"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live.metrics()["jaxllm:num_requests_waiting"] == before + 1
    conn.close()
    while live.metrics()["jaxllm:num_requests_waiting"] > before and time.monotonic() < deadline + 10:
        time.sleep(0.01)
    assert live.metrics()["jaxllm:num_requests_waiting"] == before  # aborted while it waited


def test_disconnect_aborts_queued_and_streaming_requests(live, client):
    before = live.metrics()["jaxllm:requests_aborted_total"]
    long = dict(model=MODEL, prompt=PROMPT, max_tokens=120, temperature=0, extra_body={"ignore_eos": True})
    stream = client.completions.create(stream=True, n=MAX_SLOTS, **long)
    it = iter(stream)
    next(it)  # the long requests fill every slot; the next ones wait behind them and their clients leave
    deadline = time.monotonic() + 10
    while live.metrics()["jaxllm:slots_in_use"] < MAX_SLOTS and time.monotonic() < deadline:
        time.sleep(0.01)
    _leave_while_queued(live, dict(model=MODEL, prompt=PROMPT, max_tokens=100, ignore_eos=True))
    _leave_while_queued(live, dict(model=MODEL, prompt=PROMPT, max_tokens=100, ignore_eos=True, stream=True))
    next(it)
    stream.close()  # the streaming client leaves mid-answer
    m = live.wait_idle()
    assert m["jaxllm:requests_aborted_total"] == before + 3  # three clients left
    assert m["jaxllm:slots_in_use"] == 0


def test_engine_failure_ends_streams_with_an_error_and_health_503(params, tok):
    """An exception on the engine thread: the open stream gets an error event, /health turns 503,
    new requests get 503, and the owner hears of it (the CLI exits non-zero)."""
    from jaxllm.engine.api import Event
    from jaxllm.engine.batching import BatchingEngine
    from jaxllm.server.app import create_app

    class Failing(BatchingEngine):
        def _deliver(self, pending):
            for item in pending.owners:
                if item is not None:
                    item.on_event(Event([5]))
            raise RuntimeError("injected engine failure")

    fatal = []
    engine = Failing(params, max_slots=MAX_SLOTS, max_context=32, max_queued=MAX_QUEUED)
    server = LiveServer(create_app(engine, tok, MODEL, on_fatal=fatal.append))
    try:
        server.wait_ready()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.APIError, match="injected engine failure"):
            for _ in c.completions.create(model=MODEL, prompt="x", max_tokens=5, stream=True):
                pass
        deadline = time.monotonic() + 10
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fatal and "injected engine failure" in fatal[0]
        assert server.get("/health")[0] == 503
        status, err, _ = _error(server.post("/v1/completions", {"model": MODEL, "prompt": "x"}))
        assert status == 503 and "injected engine failure" in err["message"]
    finally:
        server.stop()


def test_a_stream_that_falls_behind_sends_each_token_once_and_one_finish(params, tok):
    """Many steps' events reaching the server at once (as when its loop is busy) are sent together:
    the text is still each token's once and in order, with one finish_reason, and completions'
    logprob offsets still count the text before each token."""
    from jaxllm.engine.batching import BatchingEngine
    from jaxllm.server.app import create_app

    class Late(BatchingEngine):  # holds back a request's events until its last
        def submit(self, request, on_event):
            held = []

            def hold(ev):
                held.append(ev)
                if ev.finish_reason is not None:
                    for e in held:
                        on_event(e)
            return super().submit(request, hold)

    engine = Late(params, max_slots=MAX_SLOTS, max_context=MAX_CONTEXT, max_queued=MAX_QUEUED, prefill_chunk=64)
    server = LiveServer(create_app(engine, tok, MODEL))
    try:
        server.wait_ready()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=30)
        for logprobs in (None, 1):
            kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=logprobs,
                      extra_body={"ignore_eos": True})
            whole = c.completions.create(**kw).choices[0]
            chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw)]
            assert "".join(ch.text for ch in chunks) == whole.text
            assert [ch.finish_reason for ch in chunks if ch.finish_reason] == ["length"]
            if logprobs:
                assert [o for ch in chunks for o in ch.logprobs.text_offset] == whole.logprobs.text_offset
    finally:
        server.stop()


def test_cli_with_more_slots_than_fit_says_so_and_exits_1():
    """A real mistake: --max-slots past the memory. The engine's process finds it before it
    allocates anything; the server says why in one line and exits 1 (no traceback, no hang)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "jaxllm", "serve", "--max-context", "2048", "--max-slots", "100000",
                          "--port", "0"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 1
    assert re.search(r"jaxllm serve: error: the engine failed: ValueError: 100000 slots of 2048 tokens do not fit: "
                     r".*\(fewer slots or a shorter max_context would\)", out.stderr)
    assert "Traceback" not in out.stderr


def test_cli_serves_the_default_model_and_drains_on_sigterm(tok):
    """`jaxllm serve` as users run it: /health 503 (saying what the start is doing) then 200, and
    the log says it too; on SIGTERM an answer in flight still completes, and the process exits 0."""
    import os
    import signal
    import subprocess
    import sys

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    # one slot and no mixed steps: 7 programs to compile, not 20 (a minute less on CI's 2 cores)
    proc = subprocess.Popen([sys.executable, "-m", "jaxllm", "serve", "--max-context", "64", "--port", str(port),
                             "--dtype", "float32", "--max-slots", "1", "--no-mixed-prefill"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        def health():
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                r = conn.getresponse()
                return r.status, r.read()
            except OSError:
                return None, None
        deadline = time.monotonic() + 300
        seen = set()
        while (status := health())[0] != 200:
            seen.add(status[0])
            if status[0] == 503:
                message = json.loads(status[1])["error"]["message"]
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.5)
        assert 503 in seen  # answered while loading and compiling
        # the last 503's: what the start was doing (it compiles for seconds here, minutes on a GPU)
        assert re.fullmatch(r"the server is loading \((model loaded in .* s|compiling \d+ programs|"
                            r"compiled \d+ (of \d+ )?programs in .* s.*)\)", message), message
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        prompt = "Once upon a time"
        stream = iter(c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}))
        text = next(stream).choices[0].text
        proc.send_signal(signal.SIGTERM)
        finishes = []
        for chunk in stream:
            text += chunk.choices[0].text
            finishes += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
        assert finishes == ["length"]
        params = jaxllm.load(dtype="float32")
        ids = tok.encode(prompt, add_special_tokens=True)
        assert text == tok.decode(_greedy(params, ids, 24), True)
        assert proc.wait(60) == 0
        log = proc.stdout.read().decode()
        for said in ("jaxllm: loading the model", "jaxllm: model loaded in", "jaxllm: compiling",
                     "jaxllm: compiled", "jaxllm: ready in"):
            assert said in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_no_compilation_after_ready(live, client):
    """Any sampling settings, logprobs, seeds and prompt lengths run on what warm-up compiled."""
    before = live.metrics()["jaxllm:compilations_total"]
    for i, extra in enumerate([dict(temperature=0.7, top_p=0.9, seed=2 ** 40), dict(temperature=1.0, logprobs=3),
                               dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.5),
                               dict(temperature=0.5, extra_body=dict(top_k=5, min_p=0.1, repetition_penalty=1.3))]):
        client.completions.create(model=MODEL, prompt="word " * (3 + 9 * i), max_tokens=3, **extra)
    assert live.metrics()["jaxllm:compilations_total"] == before


def test_seeded_answers_are_the_same_under_concurrent_load(client):
    from concurrent.futures import ThreadPoolExecutor

    def ask(seed):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=seed,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    alone = [ask(s) for s in (1, 2, 3)]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(ask, (3, 1, 2)))
    assert together == [alone[2], alone[0], alone[1]]


def test_streamed_text_never_splits_a_character(client):
    """Random tokens of a byte-level vocabulary: the pieces join to the whole answer, and none
    carries a replacement character the whole answer does not."""
    for seed in range(3):
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=1.5, seed=seed,
                  extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw).choices[0].text
        pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
        assert "".join(pieces) == whole
        if "\ufffd" not in whole:
            assert all("\ufffd" not in p for p in pieces)


def test_seeded_sampling_equals_generate(client, params, tok):
    ids = tok.encode(PROMPT, add_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, top_p=0.9, seed=5,
                                  extra_body={"ignore_eos": True, "top_k": 50})
    out = jaxllm.generate(params, [ids], max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=5,
                          eos_token_ids=[])
    assert r.choices[0].text == tok.decode([int(t) for t in np.asarray(out.tokens[0])], True)


def test_a_speculative_engine_streams_greedys_answer(params, tok):
    """`--speculate ngram`: a step's accepted tokens reach the stream as one event's text, which is
    greedy's answer, with exact usage and a stop id inside an accepted run ending the choice. The
    model without its attention's output retells its own trajectory, which the prompt holds."""
    from jaxllm.engine.batching import BatchingEngine
    from jaxllm.engine.speculative import NGram
    from jaxllm.server.app import create_app

    cycling = params.replace(layers=[layer.replace(wo=layer.wo * 0) for layer in params.layers])
    y = 1000
    told = _greedy(cycling, [y], 10)
    prompt = [y] + told + [y]  # its answer begins with told again, which lookup drafts
    engine = BatchingEngine(cycling, max_slots=MAX_SLOTS, max_context=32, max_queued=MAX_QUEUED,
                            speculative=NGram(min_n=1), num_speculative=3)
    server = LiveServer(create_app(engine, tok, MODEL))
    try:
        server.wait_ready()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=30)
        kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        expected = _greedy(cycling, prompt, 16)
        assert expected[:10] == told
        assert "".join(ch.choices[0].text for ch in chunks[:-1]) == tok.decode(expected, True)
        assert chunks[-1].usage.completion_tokens == 16
        assert [ch.choices[0].finish_reason for ch in chunks[:-1] if ch.choices[0].finish_reason] == ["length"]
        assert len(chunks) - 1 < 16  # some chunks carried several tokens
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                 extra_body={"ignore_eos": True, "stop_token_ids": [told[3]]})
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == told.index(told[3]) + 1
        assert server.metrics()["jaxllm:spec_decode_num_accepted_tokens_total"] > 0
    finally:
        server.stop()
