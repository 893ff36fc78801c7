"""Prometheus metrics of the server, under vLLM's names with a `jaxllm:` prefix (dashboards and
benchmark tools written for vLLM read them unchanged).

Latencies and token counts are observed by the server as events arrive; what the engine knows
(running, waiting, slots, compilations) is read from `engine.stats()` when /metrics is scraped,
so nothing polls it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets for these three histograms
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
         20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
         40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
        480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    def __init__(self, engine):
        self._engine = engine

    def collect(self):
        s = self._engine.stats()
        for name, key, doc in (("num_requests_running", "running", "Requests on the engine's slots."),
                               ("num_requests_waiting", "waiting", "Requests waiting for a slot."),
                               ("slots_in_use", "slots_in_use", "Engine slots holding a request.")):
            yield GaugeMetricFamily(f"jaxllm:{name}", doc, value=s[key])
        yield CounterMetricFamily("jaxllm:compilations", "XLA compilations in this process.",
                                  value=s["compilations"])
        for name, key, doc in (("spec_decode_num_verify_steps", "spec_steps", "Speculative verify steps with a draft."),
                               ("spec_decode_num_draft_tokens", "spec_proposed", "Draft tokens checked."),
                               ("spec_decode_num_accepted_tokens", "spec_accepted", "Draft tokens accepted.")):
            if key in s:  # vLLM's names; an engine that does not speculate may not count them
                yield CounterMetricFamily(f"jaxllm:{name}", doc, value=s[key])


class Metrics:
    """The server's collectors, on a registry of their own (several apps in one process each count
    their own requests)."""

    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine))
        self.ttft = Histogram("jaxllm:time_to_first_token_seconds", "Time to the first token.",
                              buckets=_TTFT, registry=r)
        self.tpot = Histogram("jaxllm:time_per_output_token_seconds",
                              "Time per output token after the first.", buckets=_TPOT, registry=r)
        self.e2e = Histogram("jaxllm:e2e_request_latency_seconds", "Request latency, end to end.",
                             buckets=_E2E, registry=r)
        self.prompt_tokens = Counter("jaxllm:prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("jaxllm:generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter("jaxllm:request_success", "Requests finished, by finish reason.",
                               ["finished_reason"], registry=r)
        self.rejected = Counter("jaxllm:requests_rejected", "Requests refused with 429 (queue full).",
                                registry=r)
        self.aborted = Counter("jaxllm:requests_aborted", "Requests whose client went away.", registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
