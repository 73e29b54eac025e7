"""What the engine returns, with vLLM's names: RequestOutput holding CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability (natural log, from the raw model logits) of one token, its rank among
    all tokens (1 = most likely) and its decoded text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob, holding the sampled token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (seconds, ``time.time()``) of a request's life, how often it was
    preempted, and how many tokens its longest sequence generated."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence. ``finish_reason`` is "stop", "length", "abort", "error" (the
    engine failed while handling this request; ``RequestOutput.error`` says why) or None while
    running; ``stop_reason`` is the stop string or stop token id that ended it, if any."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step (streaming) or at its end (offline)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: per prompt token (None for the first), its Logprob
    # and the top alternatives.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set when the request failed inside the engine (its outputs' finish_reason is "error").
    error: str | None = None


@dataclass
class BeamSearchSequence:
    """A finished beam: all token ids (prompt + generated), the generated text, the summed
    logprob of the generated tokens and the length-penalised score beams are ranked by."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


@dataclass
class KVGroupStats:
    """One KV group of layers that share a block table per sequence (kv/spec.py
    ``KVLayout``): ``window`` (None: full attention; else the sliding window in positions),
    its ``layers``, ``bytes_per_token`` (what a token's slot of its blocks costs: the layers a
    block holds, K and V, scales included), and ``num_used_blocks`` in it now."""

    window: int | None
    layers: tuple[int, ...]
    bytes_per_token: int
    num_used_blocks: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)


@dataclass
class KVCacheStats:
    """A snapshot of the paged KV cache.

    Blocks: ``num_free_blocks`` (empty) + ``num_cached_blocks`` (free but holding a reusable
    prefix) + ``num_used_blocks`` (referenced) == ``num_blocks``. ``peak_used_blocks``: the
    most blocks in use at any moment (within a step too: a sliding-window group returns
    blocks after the step that needed them). ``kv_token_utilization`` is measured at the end
    of the step with the most blocks in use: slots holding real K/V state divided by the
    slots of all allocated blocks. ``prefix_cache_queries`` / ``prefix_cache_hits`` count
    prompt tokens looked up / found in the prefix cache. ``kv_sharing_saving`` is the share of
    block memory saved by sharing (prefix hits, forks), averaged over steps: 1 - (blocks used)
    / (blocks the sequences' tables hold, counted per sequence). ``reserved_slot_utilization``:
    slots holding K/V over slots reserved (allocated blocks when paged, max_model_len runs
    with ``kv_allocator="contiguous"``), summed over steps; ``_at_peak`` at the step with the
    most reserved slots; ``max_num_running`` the most requests in one batch.
    ``kv_bytes_per_token`` counts every layer; ``kv_groups`` gives each KV group (one for a
    model with one kind of attention; a hybrid model's sliding-window groups hold only the
    blocks their window reaches, so a long sequence costs less than ``kv_bytes_per_token``
    per token).
    """

    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_used_blocks: int
    peak_used_blocks: int
    num_preemptions: int
    kv_token_utilization: float
    kv_bytes_per_token: int = 0
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    kv_sharing_saving: float = 0.0
    reserved_slot_utilization: float = 0.0
    reserved_slot_utilization_at_peak: float = 0.0
    peak_reserved_slots: int = 0
    max_num_running: int = 0
    kv_groups: list[KVGroupStats] = field(default_factory=list)
