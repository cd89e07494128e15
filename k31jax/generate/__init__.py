"""Generation: a jitted prefill/decode engine with sampling over explicit caches."""

from ._engine import Engine, GenerationResult, SamplingParams, bucket_length, sample_logits

__all__ = ["Engine", "GenerationResult", "SamplingParams", "bucket_length", "sample_logits"]
