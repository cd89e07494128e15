"""Prometheus text-format metrics of a ``Scheduler`` (no client library: a handful of gauges
and counters in the documented exposition format, version 0.0.4)."""

from __future__ import annotations

import numpy as np


def _line(out: list[str], name: str, kind: str, help_: str, value, labels: str = "") -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} {kind}")
    out.append(f"{name}{labels} {value}")


def render_metrics(s, ttft_by_endpoint=None) -> str:
    """The metrics of scheduler `s`; `ttft_by_endpoint`: recent times to first token per route."""
    out: list[str] = []
    st = s.stats
    _line(out, "k31jax_queue_depth", "gauge", "Requests waiting for a slot.", s.queue_depth)
    _line(out, "k31jax_running_requests", "gauge", "Requests prefilling or decoding.", s.running)
    _line(out, "k31jax_max_batch", "gauge", "Decode slots.", s.max_batch)
    _line(out, "k31jax_requests_total", "counter", "Requests that started generating.", st["requests"])
    _line(out, "k31jax_cancelled_requests_total", "counter", "Requests cancelled by their client.",
          st["cancelled"])
    _line(out, "k31jax_prompt_tokens_total", "counter", "Prompt tokens of started requests.", st["prompt_tokens"])
    _line(out, "k31jax_generated_tokens_total", "counter", "Generated tokens.", st["generated_tokens"])
    _line(out, "k31jax_tokens_per_second", "gauge", "Generated tokens per second over recent decode steps.",
          f"{s.tokens_per_second():.3f}")
    ttft = np.asarray(s.ttft_seconds, float)
    out.append("# HELP k31jax_time_to_first_token_seconds Time from submission to the first token "
               "(recent requests).")
    out.append("# TYPE k31jax_time_to_first_token_seconds summary")
    for q in (0.5, 0.9, 0.99):
        v = float(np.quantile(ttft, q)) if ttft.size else float("nan")
        out.append(f'k31jax_time_to_first_token_seconds{{quantile="{q}"}} {v:.6f}')
    out.append(f"k31jax_time_to_first_token_seconds_sum {ttft.sum():.6f}")
    out.append(f"k31jax_time_to_first_token_seconds_count {ttft.size}")
    out.append("# HELP k31jax_endpoint_time_to_first_token_seconds Time to the first token per endpoint "
               "(recent requests).")
    out.append("# TYPE k31jax_endpoint_time_to_first_token_seconds summary")
    for endpoint, times in sorted((ttft_by_endpoint or {}).items()):
        values = np.asarray(list(times), float)
        for q in (0.5, 0.9, 0.99):
            v = float(np.quantile(values, q)) if values.size else float("nan")
            out.append(f'k31jax_endpoint_time_to_first_token_seconds{{endpoint="{endpoint}",quantile="{q}"}} {v:.6f}')
        out.append(f'k31jax_endpoint_time_to_first_token_seconds_count{{endpoint="{endpoint}"}} {values.size}')
    p = s.prefix
    _line(out, "k31jax_prefix_cache_hits_total", "counter", "Requests resumed from a stored prefix.", p.hits)
    _line(out, "k31jax_prefix_cache_misses_total", "counter", "Requests prefilled from scratch.", p.misses)
    _line(out, "k31jax_prefix_cache_hit_rate", "gauge", "Prefix cache hits / lookups.", f"{p.hit_rate:.4f}")
    _line(out, "k31jax_prefix_cache_cached_tokens_total", "counter", "Prompt tokens restored, not prefilled.",
          st["cached_tokens"])
    _line(out, "k31jax_prefix_cache_bytes", "gauge", "Host bytes held by prefix snapshots.", p.bytes)
    _line(out, "k31jax_prefix_cache_entries", "gauge", "Prefix snapshots held.", len(p))
    grammar = np.asarray(s.grammar_seconds, float)
    out.append("# HELP k31jax_grammar_seconds_per_token Host time of one grammar row's next-token mask "
               "(recent masked tokens; filled while the device runs the step's forward pass).")
    out.append("# TYPE k31jax_grammar_seconds_per_token summary")
    for q in (0.5, 0.99):
        v = float(np.quantile(grammar, q)) if grammar.size else float("nan")
        out.append(f'k31jax_grammar_seconds_per_token{{quantile="{q}"}} {v:.9f}')
    out.append(f"k31jax_grammar_seconds_per_token_count {grammar.size}")
    _line(out, "k31jax_grammar_requests_total", "counter", "Requests decoded under a grammar.",
          st["grammar_requests"])
    _line(out, "k31jax_grammar_broken_total", "counter", "Grammar rows a forced id left (a budget cut the reply).",
          st["grammar_broken"])
    _line(out, "k31jax_cache_compactions_total", "counter", "Slot-cache compactions.", st["compactions"])
    spec = s.speculator.stats if s.speculator is not None else None
    _line(out, "k31jax_speculative_verify_steps_total", "counter", "Decode steps that verified drafts (--speculate).",
          st["verify_steps"])
    _line(out, "k31jax_speculative_drafted_tokens_total", "counter", "Draft tokens verified.",
          0 if spec is None else spec.drafted)
    _line(out, "k31jax_speculative_accepted_tokens_total", "counter", "Draft tokens kept.",
          0 if spec is None else spec.accepted)
    out.append("# HELP k31jax_compiles_total Programs compiled, per kind (stable after warm-up).")
    out.append("# TYPE k31jax_compiles_total counter")
    for kind, n in sorted(s.compile_counts.items()):
        out.append(f'k31jax_compiles_total{{kind="{kind}"}} {n}')
    return "\n".join(out) + "\n"
