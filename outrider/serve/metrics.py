"""Prometheus metrics of the server, under vLLM's names where vLLM has one (dashboards carry over).

    outrider:request_success_total{finished_reason}        requests ended (stop, length, abort)
    outrider:prompt_tokens_total / generation_tokens_total  tokens in and out
    outrider:time_to_first_token_seconds                    arrival -> first output token
    outrider:time_per_output_token_seconds                  one observation per output token after the first:
                                                            the time since the previous round over the tokens
                                                            that round committed
    outrider:e2e_request_latency_seconds                    arrival -> end
    outrider:num_requests_running / num_requests_waiting    gauges, set after every step
    outrider:kv_rows_used / kv_rows_reserved / kv_rows_total   K/V rows: committed, reserved, allocated
    outrider:kv_cache_usage_perc                            K/V usage, 0..1: rows committed over rows allocated
    outrider:prefix_cache_queries_total                     prompt tokens looked up in the prefix cache
    outrider:prefix_cache_hits_total                        of those, tokens whose K/V the cache gave
    outrider:prefix_cache_usage_perc                        the prefix cache's pool in use, 0..1 (not vLLM's)
    outrider:spec_decode_num_drafts_total                   rounds that drafted at least one token
    outrider:spec_decode_num_draft_tokens_total             draft tokens verified
    outrider:spec_decode_num_accepted_tokens_total          draft tokens accepted
    outrider:spec_decode_num_accepted_tokens_per_pos_total{position}   accepted at depth position+1

Request and speculation counters are added when a request ends, from its own RoundStats, so
they equal the sums of the per-request figures (each response's `outrider` field).
The prefix cache's counters count tokens, as vLLM's prefix_cache_queries and prefix_cache_hits
do (hits / queries is the hit rate); they move after the step that admitted a request.
Every metric carries the label model_name, as vLLM's do.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .responses import OPENAI_REASON

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model = model_name
        r, m = self.registry, ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(f"outrider:{name}", doc, [*m, *extra], registry=r)

        def gauge(name, doc):
            return Gauge(f"outrider:{name}", doc, m, registry=r).labels(self.model)

        self._success = counter("request_success", "Requests ended, by finish reason", ["finished_reason"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of ended requests").labels(self.model)
        self.generation_tokens = counter("generation_tokens", "Output tokens of ended requests").labels(self.model)
        self.ttft = Histogram("outrider:time_to_first_token_seconds", "Arrival to first output token", m,
                              buckets=LATENCY, registry=r).labels(self.model)
        self.tpot = Histogram("outrider:time_per_output_token_seconds", "Time per output token after the first",
                              m, buckets=PER_TOKEN, registry=r).labels(self.model)
        self.e2e = Histogram("outrider:e2e_request_latency_seconds", "Arrival to end", m, buckets=LATENCY,
                             registry=r).labels(self.model)
        self.running = gauge("num_requests_running", "Requests holding a slot")
        self.waiting = gauge("num_requests_waiting", "Requests queued for a slot")
        self.kv_used = gauge("kv_rows_used", "K/V rows holding committed tokens")
        self.kv_reserved = gauge("kv_rows_reserved", "K/V rows reserved by running requests")
        self.kv_total = gauge("kv_rows_total", "K/V rows allocated (slots x rows per slot)")
        self.drafts = counter("spec_decode_num_drafts", "Rounds that drafted").labels(self.model)
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified").labels(self.model)
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted").labels(self.model)
        self.kv_usage = gauge("kv_cache_usage_perc", "K/V usage: rows holding committed tokens over rows allocated")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache").labels(
            self.model)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens whose K/V the prefix cache gave").labels(
            self.model)
        self.prefix_usage = gauge("prefix_cache_usage_perc", "The prefix cache's blocks in use over its capacity")
        self._prefix_seen = (0, 0)  # the cache's (queries, hits) at the last step
        self._per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position",
                                ["position"])

    def request_ended(self, completion, prompt_tokens: int, ttft: float | None, e2e: float) -> None:
        """An engine Completion ended: count it and its own speculation counters."""
        s, output_tokens = completion.round_stats, len(completion.token_ids)
        self._success.labels(self.model, OPENAI_REASON[completion.finish_reason]).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
        if s.proposed_by_position:
            self.drafts.inc(s.proposed_by_position[0])
        self.draft_tokens.inc(s.drafted)
        self.accepted.inc(sum(s.accepted_by_position))
        for position, n in enumerate(s.accepted_by_position):
            self._per_pos.labels(self.model, str(position)).inc(n)

    def output_tokens(self, gaps: list[float]) -> None:
        """Output tokens after a request's first, each with its share of the time since the last round."""
        for gap in gaps:
            self.tpot.observe(gap)

    def engine_state(self, running: int, waiting: int, kv_used: int, kv_reserved: int, kv_total: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used.set(kv_used)
        self.kv_reserved.set(kv_reserved)
        self.kv_total.set(kv_total)
        self.kv_usage.set(kv_used / kv_total if kv_total else 0.0)

    def prefix_cache_state(self, cache) -> None:
        """The prefix cache's counters (engine/prefix_cache.py PrefixCache: cumulative queries and
        hits, in tokens) and its pool's use, after a step."""
        queries, hits = cache.queries, cache.hits
        self.prefix_queries.inc(queries - self._prefix_seen[0])
        self.prefix_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)
        self.prefix_usage.set(cache.usage())

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

