"""The generation loop: prefill the new tokens, then sample / decode until a stop condition.

Per generated token the Python work is one sample, one detokenizer push and one stop-string
check; everything else is set up once per reply. Greedy decoding with the library's argmax runs
batches of steps (as many as take :data:`AHEAD_BURST_S`), the token ids fed back on the device;
the next batch is queued before one is read, and what a stop condition leaves unused is rolled
back.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from app.inference.api import PrefillProgress, ReplyStats, SamplingParams, TextDelta
from app.inference.engine.runtime import PICKED_CAPACITY, ModelRuntime
from app.inference.engine.sampling import Sampler
from app.inference.engine.stop import StopMatcher
from app.inference.engine.tokenizer import StreamDecoder, Tokenizer

#: most greedy decode steps per device round trip (the token ids fed back on the device); a reply
#: that stops earlier rolls the unused steps back
GREEDY_AHEAD = 32
#: how long one such batch of steps should last: the reply appears in bursts of this length (about
#: a frame of a 30 Hz terminal), so fast GPUs batch many steps and slow ones one or two. H200,
#: engine end to end (BENCHMARKS.md): one round trip per token -> batches (runs 15 -> 16, the same
#: kernels): Llama-2-7B shape 1,914 -> 1,857 us per token, Qwen2.5-0.5B 858 -> 807; the next batch
#: queued before one is read (runs 19 -> 20): 0.5B 651 -> 647, 7B unchanged within spread
AHEAD_BURST_S = 0.03
#: steps of the first batch of a reply (before its step time is known)
FIRST_AHEAD = 4


class GreedyBatches:
    """Greedy tokens decoded on the device in batches: the library's argmax feeds each step's id
    to the next step on the GPU, a batch lasts about :data:`AHEAD_BURST_S` (at most ``max_steps``
    steps), and the next batch is queued before one is read, so the GPU does not wait for the
    host. The steps decoded but not used stay in the KV cache until :meth:`rollback`."""

    def __init__(self, runtime: ModelRuntime, max_steps: int) -> None:
        self.runtime = runtime
        self.max_steps = max(1, max_steps)
        self.steps = min(self.max_steps, FIRST_AHEAD)  # the next batch's length
        self.ahead: deque[int] = deque()  # decoded, read, not used yet
        self.queued: deque[tuple[int, Callable[[], list[int]]]] = deque()  # queued, not read yet
        # two batches in flight where the runtime reads ids behind queued work (CUDA, Vulkan): the
        # host records batch k+1 while the GPU runs batch k
        self.depth = (
            2
            if (getattr(runtime, "reads_behind_queued_work", False) and self.max_steps <= PICKED_CAPACITY)
            else 1
        )
        self._t_batch = 0.0

    @property
    def unused(self) -> int:
        """Steps in the KV cache that the reply has not used (yet)."""
        return len(self.ahead) + sum(steps for steps, _ in self.queued)

    def _room(self, tokens_left: int) -> int:
        return min(self.steps, tokens_left, self.runtime.context_window - self.runtime.sequence_length)

    def next(self, token: int, tokens_left: int) -> int:
        """The greedy token after ``token`` (the last one the reply used); ``tokens_left``: how
        many more the reply may still take, this one included."""
        if not self.ahead:
            if not self.queued:
                steps = max(1, self._room(tokens_left))
                self.queued.append((steps, self.runtime.start_greedy_ahead(token, steps)))
                self._t_batch = time.perf_counter()
            while len(self.queued) < self.depth:  # queued before the oldest batch is read
                more = self._room(tokens_left - self.unused)
                if more <= 0:
                    break
                self.queued.append((more, self.runtime.start_greedy_ahead(None, more)))
            steps, wait = self.queued.popleft()
            ids = wait()
            now = time.perf_counter()
            per_step = max(now - self._t_batch, 1e-6) / steps
            self.steps = max(1, min(self.max_steps, int(AHEAD_BURST_S / per_step)))
            self._t_batch = now
            if not self.queued:
                more = self._room(tokens_left - len(ids))  # queued before this batch is used
                if more > 0:
                    self.queued.append((more, self.runtime.start_greedy_ahead(None, more)))
            self.ahead.extend(ids)
        return self.ahead.popleft()

    def rollback(self) -> None:
        """Take the steps the reply did not use out of the KV cache (waits for a queued batch)."""
        unused = self.unused
        while self.queued:
            self.queued.popleft()[1]()  # their steps are in the KV cache once they have run
        self.ahead.clear()
        if unused:
            self.runtime.popn(unused)


@dataclass
class GenerationResult:
    """What one generation produced (filled in while it runs)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stats: ReplyStats = field(default_factory=ReplyStats)


def generate(
    runtime: ModelRuntime,
    new_ids: Sequence[int],
    params: SamplingParams,
    *,
    kv_ids: list[int],
    cancel: threading.Event,
    tokenizer: Tokenizer | None = None,
    stop_token_ids: Collection[int] = (),
    stop_strings: Sequence[str] = (),
    result: GenerationResult | None = None,
    greedy_ahead: int = GREEDY_AHEAD,
) -> Iterator[TextDelta | ReplyStats]:
    """Prefill ``new_ids`` (appended to ``kv_ids``), stream the reply, end with ``ReplyStats``.

    A prompt of more than one token yields ``PrefillProgress`` before its prefill and after each
    prefill chunk but the last; ``cancel`` is checked between chunks.

    ``kv_ids`` mirrors the tokens in the runtime's KV cache and is extended in place.
    ``tokenizer=None`` skips detokenization (benchmarks). Raises nothing on cancel: the reply
    ends with ``finish_reason="cancelled"``. ``greedy_ahead``: most decode steps per call for
    greedy decoding with the library's argmax (1: one round trip per token)."""
    result = result if result is not None else GenerationResult()
    stats = result.stats
    stats.prompt_tokens = len(new_ids)
    sampler = Sampler(params)
    stream = StreamDecoder(tokenizer) if tokenizer is not None else None
    matcher = StopMatcher(list(params.stop) + list(stop_strings)) if stream is not None else None
    stop_ids = frozenset(stop_token_ids)
    generated = result.token_ids
    pieces: list[str] = []
    max_tokens = max(1, int(params.max_tokens))
    context_window = runtime.context_window

    # greedy decoding with a device-side argmax: only token ids cross to the host, in batches
    device_greedy = sampler.is_plain_greedy and runtime.has_device_argmax
    batches = GreedyBatches(runtime, greedy_ahead) if device_greedy else None
    next_token: int | None = None
    t_start = time.perf_counter()
    before = runtime.sequence_length
    # the prompt, chunk by chunk: a PrefillProgress before it starts and after each chunk but the last
    total = len(new_ids)
    steps = runtime.prefill_steps(list(new_ids), cancel=cancel)
    if total > 1:
        yield PrefillProgress(0, total, 0.0)
    try:
        while True:
            try:
                done = next(steps)
            except StopIteration as finished:
                logits = finished.value
                break
            yield PrefillProgress(done, total, time.perf_counter() - t_start)
    finally:  # also when the consumer stops mid-prefill: kv_ids mirrors the chunks in the KV cache
        kv_ids.extend(new_ids[: runtime.sequence_length - before])
    t_prefilled = time.perf_counter()
    stats.prefill_s = t_prefilled - t_start
    finish = "stop"
    stopped_by_string = False
    if logits is None:  # cancelled during the prefill: no token generated
        stats.prompt_tokens = runtime.sequence_length - before
        stats.finish_reason = "cancelled"
        yield stats
        return
    try:
        while True:
            token = sampler.sample(logits, generated) if next_token is None else next_token
            generated.append(token)
            if len(generated) == 1:
                stats.time_to_first_token_s = time.perf_counter() - t_start
            if token in stop_ids:
                break
            if stream is not None:
                text = stream.push(token)
                if text:
                    safe, stopped = matcher.push(text)
                    if safe:
                        pieces.append(safe)
                        yield TextDelta(safe)
                    if stopped:
                        stopped_by_string = True
                        break
            if len(generated) >= max_tokens:
                finish = "length"
                break
            if cancel.is_set():
                finish = "cancelled"
                break
            unused = batches.unused if batches is not None else 0  # decoded ahead, in the KV cache
            if runtime.sequence_length - unused + 1 > context_window:
                finish = "context"
                break
            if batches is not None:
                next_token = batches.next(token, max_tokens - len(generated))
            else:
                logits = runtime.decode(token)
            kv_ids.append(token)
    finally:  # decoded past the end of the reply (or closed early): roll the unused steps back
        if batches is not None:
            batches.rollback()
    stats.decode_s = time.perf_counter() - t_prefilled
    if stream is not None and not stopped_by_string:
        tail = matcher.push(stream.flush())[0] + matcher.flush()
        if tail:
            pieces.append(tail)
            yield TextDelta(tail)
    stats.generated_tokens = len(generated)
    stats.finish_reason = finish
    result.text = "".join(pieces)
    yield stats
