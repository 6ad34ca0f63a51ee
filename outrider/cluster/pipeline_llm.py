"""`split_llm`: an `LLM`'s target put on pipeline stages (pipeline.py), in place.

The entry `outrider serve --pipeline-stages N` (serve/server.py) and the tests use: the LLM is
built as usual (tokenizer, drafter), then its target is replaced by a `PipelineTarget` and its
speculator rebuilt for it.
"""

from __future__ import annotations

from ..errors import ConfigError
from .pipeline import TRANSPORTS, check_options, local_pipeline


def split_llm(llm, stages: int, *, hop_ms: float = 0.0, rewind: str = "trim", transport: str = "ray",
              micro_batches: int = 1, threads: int | None = None, runtime=None, dtype: str | None = None,
              kv_dtype: str | None = None, address: str | None = None):
    """Put `llm`'s target on `stages` pipeline stages (in place; returns llm): "local" cuts the
    loaded target in this process, "ray" starts a Ray actor a stage, each loading its layers from
    the model folder, and lets this process's copy go. Its drafter is rebuilt for the new target
    (a draft model stays on this process, the coordinator). dtype, kv_dtype: the strings `llm` was
    built with (the stages load the folder as it did); address: a Ray cluster to join."""
    from ..engine.speculator import Speculator

    if transport not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    check_options(llm.target.config, stages, hop_ms, rewind, micro_batches)
    if transport == "local" and micro_batches > 1:
        raise ConfigError("micro-batches overlap stages that run at once: they need the ray transport")
    spec = llm.speculator
    if spec is not None and (spec.hidden_layers or spec.reads_target_cache
                             or spec.drafter.capabilities.needs_attention):
        raise ConfigError(f"the {spec.options.kind} drafter reads the target's hidden states, layers or attention, "
                          "which live on the pipeline's stages: use draft-model, suffix or ngram with --pipeline-stages")
    if transport == "local":
        target = local_pipeline(llm.target, stages, hop_ms=hop_ms, rewind=rewind)
    else:
        from .pipeline_ray import ray_pipeline

        target = ray_pipeline(llm.path, llm.target, stages, hop_ms=hop_ms, rewind=rewind,
                              micro_batches=micro_batches, threads=threads, runtime=runtime, dtype=dtype,
                              kv_dtype=kv_dtype, address=address)
    llm.target = target
    if spec is not None:
        llm.speculator = Speculator.build(spec.options, target, llm.path)
    return llm
