"""The engine worker: one thread that decodes up to ``parallel`` requests together, taking them in arrival order from
a bounded queue.

Each of the ``parallel`` slots owns a :class:`~sparsespec.engine.Session` (its own arenas: policy, budget and
positions as the flags set them), so memory is fixed per slot, and a request whose prompt extends the text a slot
holds (the next turn of a chat) goes to that slot and resumes from its cache. The requests in the slots run as
decoding programs in one :class:`~sparsespec.passes.Batch`: each step is one pass over the rows of all of them
(prompt chunks included), a new request joins between steps, and a finished or abandoned one frees its slot at the
next. Results travel back to the asyncio event loop as events on a per-job :class:`asyncio.Queue`; the loop never
waits on the model.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field

from ..engine import CacheOptions, DraftOptions, RunStats, Session, check_fits_context
from ..errors import UserError, user_message
from ..flags import PARAMETER_FLAGS
from ..generate import TextStream
from ..loading.huge_pages import hold_slow_huge_page_moves, release_slow_huge_page_moves
from ..loading.load import LoadedModel
from ..loading.tokenizer import eos_token_ids
from ..ngram import DEFAULT_SHARED_TOKENS, SharedTexts
from ..passes import Batch, Running
from ..sampling import SamplingParams

log = logging.getLogger("sparsespec.serve")

# The first text of a job goes to the event loop at once; after that at most once per interval, with every piece
# decoded meanwhile. Each hand-over wakes the event loop's thread, which then competes with the engine's threads
# for the cores: once per token it cost a fast model a noticeable share of its speed, once per interval it costs
# nothing measurable, and a model slower than one token per interval still hands over every token as it comes:
# benchmarks/history/decode.md#native-kernels-third-pass-q4_k--q6_k-in-column-tiles-and-the-servers-engine-thread
TEXT_INTERVAL_SECONDS = 0.025


# The library's parameters (errors.ConfigError) as the server's user names them: a request's fields for what a
# request sets (GenerationRequest), the server's start flags for the rest.
REQUEST_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p"}
SERVER_NAMES = {**PARAMETER_FLAGS, **REQUEST_FIELDS, "shared_ngram_tokens": "--ngram-shared-tokens"}


class QueueFull(Exception):
    """The bounded queue holds as many waiting requests as it may."""


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, in token ids. ``seed`` None draws a random one; ``ignore_eos``: end-of-sequence tokens do not
    end it (they are generated like any other token, and streamed as their text); ``cache_salt``: see
    :meth:`EngineWorker._slot_for`."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    cache_salt: str | None = None  # resumes only from text a request with the same salt left in a slot


@dataclass
class JobResult:
    """What a finished job reports: why it stopped, its statistics and the session's state after it."""

    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    stats: RunStats
    queue_seconds: float
    first_text_seconds: float  # from leaving the queue to the first text piece
    conversation_evicted_tokens: int


@dataclass
class Job:
    """A request in flight. Events on ``events``: ``("text", str)``…, then ``("done", JobResult)`` or
    ``("error", (http_status, message))``."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Stop this job before its next decode step (or skip it, if it is still queued)."""
        self.cancelled.set()

    def emit(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Metrics:
    """Counters for ``GET /metrics``, written by the worker thread and read by the event loop."""

    COUNTERS = {
        "requests_total": "generation requests finished",
        "request_errors_total": "generation requests that ended in an error",
        "requests_rejected_total": "requests answered 503 because the queue was full",
        "requests_cancelled_total": "requests whose client went away before they finished",
        "server_errors_total": "requests answered 500 because of an unexpected error",
        "prompt_tokens_total": "prompt tokens of finished requests",
        "reused_prompt_tokens_total": "prompt tokens resumed from the cache instead of read again",
        "generated_tokens_total": "tokens generated",
        "evicted_tokens_total": "KV entries evicted (per layer and head) by the target's cache",
        "drafted_tokens_total": "tokens proposed by the draft (model and n-gram proposals)",
        "accepted_tokens_total": "draft tokens the target accepted",
        "ngram_drafted_tokens_total": "tokens proposed from n-gram matches in the text (part of drafted_tokens_total)",
        "ngram_accepted_tokens_total": "n-gram proposals the target accepted",
        "ngram_shared_drafted_tokens_total": "n-gram proposals matched in other requests' text (part of the above)",
        "ngram_shared_accepted_tokens_total": "of those, the ones the target accepted",
        "target_passes_total": "target forward passes of speculative decoding",
        "engine_steps_total": "passes the engine ran (each over the rows of every request it served at once)",
        "batch_rows_total": "rows those passes ran (over engine_steps_total: rows per step)",
    }
    GAUGES = {
        "last_tokens_per_second": "decode speed of the last finished request",
        "kv_cache_bytes": "bytes of the key and value buffers, all slots",
        "slots": "requests the engine decodes at once (--parallel)",
        "slots_busy": "slots running a request",
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys([*self.COUNTERS, *self.GAUGES], 0.0)

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self.values[name] += amount

    def set(self, **values: float) -> None:
        with self._lock:
            self.values.update(values)

    def render(self, queue_length: int) -> str:
        """Prometheus text exposition format."""
        with self._lock:
            values = dict(self.values)
        lines = []
        for kinds, kind in ((self.COUNTERS, "counter"), (self.GAUGES, "gauge")):
            for name, help_text in kinds.items():
                lines += [f"# HELP sparsespec_{name} {help_text}", f"# TYPE sparsespec_{name} {kind}",
                          f"sparsespec_{name} {values[name]:.12g}"]
        drafted = values["drafted_tokens_total"]
        lines += ["# HELP sparsespec_acceptance_rate accepted over drafted tokens since the start",
                  "# TYPE sparsespec_acceptance_rate gauge",
                  f"sparsespec_acceptance_rate {values['accepted_tokens_total'] / drafted if drafted else 0:g}",
                  "# HELP sparsespec_queue_length requests waiting for the engine",
                  "# TYPE sparsespec_queue_length gauge",
                  f"sparsespec_queue_length {queue_length}"]
        return "\n".join(lines) + "\n"


# The longest prompt a server takes by default where a budgeted cache with in-cache positions lets a run outgrow
# the model's context: a conversation's whole history is its prompt, and reading a million tokens takes hours here.
UNBOUNDED_MAX_PROMPT_TOKENS = 2**20
# Bounds of the server's sizes: each slot holds its own arenas, and each waiting request its prompt.
MAX_PARALLEL, MAX_QUEUE_SIZE = 256, 65536


def check_worker_options(cache: CacheOptions, queue_size: int, no_evict_overflow: bool, parallel: int = 1,
                         max_prompt_tokens: int | None = None) -> None:
    """Raise :class:`UserError` for a queue bound, slot count or prompt limit out of range, or
    ``--no-evict-overflow`` where it would do nothing."""
    if not 1 <= parallel <= MAX_PARALLEL:
        raise UserError(f"--parallel must be from 1 to {MAX_PARALLEL} (got {parallel}).")
    if not 1 <= queue_size <= MAX_QUEUE_SIZE:
        raise UserError(f"--queue-size must be from 1 to {MAX_QUEUE_SIZE} (got {queue_size}).")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise UserError(f"--max-prompt-tokens must be at least 1 (got {max_prompt_tokens}).")
    if no_evict_overflow and (cache.policy.is_full or cache.positions == "original"):
        raise UserError(
            "--no-evict-overflow only matters with a budgeted policy and --positions in-cache; "
            "other caches refuse an overlong prompt anyway."
        )


@dataclass
class _Slot:
    """One of the engine's slots: its session (arenas and the text they hold) and the job it runs, if any."""

    session: Session
    last_used: float = 0.0
    salt: str | None = None  # the cache_salt of the request that left the session's text
    job: Job | None = None
    running: Running | None = None  # the job's program in the batch
    stats: RunStats | None = None
    text: TextStream | None = None
    started: float = 0.0
    first_text: float | None = None
    pending: list[str] = field(default_factory=list)  # text not handed over yet
    handed_over: float = 0.0

    def hand_over(self) -> None:
        if self.pending:
            self.job.emit("text", "".join(self.pending))
            self.pending.clear()


class EngineWorker:
    """The engine thread, its bounded queue and ``parallel`` slots, each with its own :class:`Session`.

    ``no_evict_overflow``: refuse a request that would run past the model's context even where the budgeted cache
    (with in-cache positions) could go on by evicting. ``max_prompt_tokens``: the longest prompt taken (None: the
    model's context where a run must fit it, else :data:`UNBOUNDED_MAX_PROMPT_TOKENS`). ``shared_ngram_tokens``: how
    many tokens of finished requests greedy n-gram drafting matches across conversations (0: none; see
    ``ngram.SharedTexts``).
    """

    def __init__(
        self,
        target: LoadedModel,
        cache: CacheOptions,
        draft: DraftOptions | None = None,
        *,
        parallel: int = 1,
        queue_size: int = 16,
        no_evict_overflow: bool = False,
        max_prompt_tokens: int | None = None,
        shared_ngram_tokens: int = DEFAULT_SHARED_TOKENS,
    ) -> None:
        check_worker_options(cache, queue_size, no_evict_overflow, parallel, max_prompt_tokens)
        self.target = target
        self.cache = cache
        self.draft = draft
        self.no_evict_overflow = no_evict_overflow
        self.context = target.config.max_position_embeddings
        if max_prompt_tokens is None:
            max_prompt_tokens = self.context if self._bounded_by_context else UNBOUNDED_MAX_PROMPT_TOKENS
        self.max_prompt_tokens = max_prompt_tokens
        self.slots = [_Slot(Session(target, cache, draft, capacity=self.context)) for _ in range(parallel)]
        # Requests' text that greedy n-gram drafting matches across conversations (ngram.SharedTexts; per salt)
        self.shared_texts = None
        if draft is not None and draft.ngram is not None and shared_ngram_tokens > 0:
            self.shared_texts = SharedTexts(shared_ngram_tokens, draft.ngram.min_n, draft.ngram.max_n)
            for slot in self.slots:
                slot.session.shared_texts = self.shared_texts
        self.eos_ids = frozenset(eos_token_ids(target.tokenizer))
        self.metrics = Metrics()
        self.metrics.set(slots=parallel)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._serve, name="sparsespec-engine", daemon=True)
        self._batch = Batch()
        self._stopping = False

    # ------------------------------------------------------------------------------------- event-loop side
    def start(self) -> None:
        """Run the engine in a thread of its own."""
        self._thread.start()

    def run(self) -> None:
        """Run the engine on the calling thread until :meth:`stop`."""
        self._serve()

    def stop(self) -> None:
        """Cancel the running jobs (they end at the next step), drop the waiting ones and end the engine's loop
        (joining its thread, if it has one)."""
        for slot in self.slots:
            if slot.job is not None:
                slot.job.cancel()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", (503, "The server is shutting down."))
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def queue_length(self) -> int:
        return self._queue.qsize()

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """``max_tokens`` when a request gives none: up to the model's context (a context's worth where a budgeted
        cache with in-cache positions could go on)."""
        return max(self.context - prompt_tokens, 1) if self._bounded_by_context else self.context

    @property
    def _bounded_by_context(self) -> bool:
        return self.no_evict_overflow or self.cache.policy.is_full or self.cache.positions == "original"

    def check(self, request: GenerationRequest) -> None:
        """Raise :class:`UserError` if the request cannot run (before it is queued)."""
        total = len(request.prompt_ids) + request.max_tokens
        if self.no_evict_overflow and total > self.context:
            raise UserError(
                f"The prompt ({len(request.prompt_ids)} tokens) plus max_tokens ({request.max_tokens}) exceeds "
                f"the model's context of {self.context} tokens, and the server runs with --no-evict-overflow."
            )
        check_fits_context(self.target, self.cache, total, "The prompt plus {max_new_tokens}")
        if self.draft is not None and self.draft.model is not None:
            check_fits_context(self.draft.model, self.draft.cache, total,
                               "The prompt plus {max_new_tokens} (for the draft)")

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a request; raises :class:`QueueFull` when the queue is at its bound."""
        job = Job(request, loop)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.metrics.add(requests_rejected_total=1)
            raise QueueFull from None
        return job

    # ------------------------------------------------------------------------------------- engine side
    def _serve(self) -> None:
        while not self._stopping:
            if not self._batch.running:
                release_slow_huge_page_moves()  # idle: a slow move of the weights may run (huge_pages.py)
            self._admit(block=not self._batch.running)
            hold_slow_huge_page_moves()
            for slot in self.slots:  # a client that went away frees its slot now
                if slot.job is not None and slot.job.cancelled.is_set():
                    slot.running.close()
            rows = self._batch.step()
            if rows:
                self.metrics.add(engine_steps_total=1, batch_rows_total=rows)
            self.metrics.set(slots_busy=sum(slot.job is not None for slot in self.slots))
        release_slow_huge_page_moves()
        for slot in self.slots:
            if slot.job is not None:
                slot.running.close()

    def _admit(self, block: bool) -> None:
        """Give queued jobs the free slots (waiting for one when ``block`` and no job runs)."""
        while not self._stopping and any(slot.job is None for slot in self.slots):
            try:
                job = self._queue.get(block=block)
            except queue.Empty:
                return
            block = False
            if job is None:
                self._stopping = True
            elif job.cancelled.is_set():
                self.metrics.add(requests_cancelled_total=1)
            else:
                self._start(job, self._slot_for(job.request))

    def _slot_for(self, request: GenerationRequest) -> _Slot:
        """The free slot whose text the prompt extends the furthest, else the one unused the longest.

        Only text left by a request with the same ``cache_salt`` counts: a client whose salt differs cannot learn,
        from ``reused_prompt_tokens`` or from a quick answer, whether another client's conversation began with
        what it guessed. (Without salts every client shares: the server's callers are one user's.)"""
        free = [slot for slot in self.slots if slot.job is None]
        return max(free, key=lambda slot: (self._reusable(slot, request), -slot.last_used))

    @staticmethod
    def _reusable(slot: _Slot, request: GenerationRequest) -> int:
        return slot.session.reusable(request.prompt_ids) if slot.salt == request.cache_salt else 0

    def _start(self, job: Job, slot: _Slot) -> None:
        request = job.request
        slot.job, slot.stats, slot.first_text, slot.handed_over = job, RunStats(), None, 0.0
        eos_ids = frozenset() if request.ignore_eos else self.eos_ids
        slot.text = TextStream(self.target.tokenizer, stop_strings=request.stop, eos_ids=eos_ids)
        slot.started = time.perf_counter()
        if slot.salt != request.cache_salt:
            slot.session.reset()  # another salt's text is never resumed from
            slot.salt = request.cache_salt
        slot.session.salt = request.cache_salt  # and n-gram drafting matches only that salt's shared text
        seed = request.seed if request.seed is not None else random.getrandbits(63)
        program = slot.session.steps(
            request.prompt_ids, max_new_tokens=request.max_tokens, sampling=request.sampling, seed=seed,
            eos_ids=eos_ids, stats=slot.stats,
        )
        running = self._batch.add(program, lambda token: self._on_token(slot, token),
                                  lambda error: self._on_end(slot, error))
        if slot.job is job:  # not ended already (an error before its first pass)
            slot.running = running

    def _on_token(self, slot: _Slot, token: int) -> bool:
        """Stream the token's text; False (stop the job) at a stop string, EOS or a cancellation."""
        pieces = slot.text.push(token)
        if pieces:
            now = time.perf_counter()
            if slot.first_text is None:
                slot.first_text = now - slot.started
            slot.pending += pieces
            if now - slot.handed_over >= TEXT_INTERVAL_SECONDS:
                slot.hand_over()
                slot.handed_over = time.perf_counter()  # after it: two hand-overs are an interval apart at least
        return not slot.text.ended and not slot.job.cancelled.is_set()

    def _on_end(self, slot: _Slot, error: BaseException | None) -> None:
        """Report the job's end and free its slot."""
        job, stats = slot.job, slot.stats
        if error is None and not slot.text.ended:
            slot.pending += slot.text.finish()
        slot.hand_over()
        slot.job, slot.running, slot.last_used = None, None, time.perf_counter()
        if isinstance(error, UserError):
            self.metrics.add(request_errors_total=1)
            job.emit("error", (400, user_message(error, SERVER_NAMES)))
            return
        if error is not None:  # the server stays up; this request ends with an error
            log.error("generation failed", exc_info=error)
            self.metrics.add(request_errors_total=1)
            job.emit("error", (500, f"Generation failed: {type(error).__name__}: {error}"))
            return
        if job.cancelled.is_set():
            self.metrics.add(requests_cancelled_total=1)
        self._count(stats)
        job.emit("done", JobResult(
            finish_reason="stop" if slot.text.ended or job.cancelled.is_set() else "length",
            stats=stats,
            queue_seconds=slot.started - job.submitted_at,
            first_text_seconds=slot.first_text if slot.first_text is not None else time.perf_counter() - slot.started,
            conversation_evicted_tokens=slot.session.evicted_tokens,
        ))

    def _count(self, stats: RunStats) -> None:
        self.metrics.add(requests_total=1, prompt_tokens_total=stats.prompt_tokens,
                         reused_prompt_tokens_total=stats.reused_tokens, generated_tokens_total=stats.new_tokens,
                         evicted_tokens_total=stats.evicted_tokens)
        if stats.speculative is not None:
            s = stats.speculative
            self.metrics.add(drafted_tokens_total=s.drafted, accepted_tokens_total=s.accepted,
                             target_passes_total=s.target_passes, ngram_drafted_tokens_total=s.ngram_drafted,
                             ngram_accepted_tokens_total=s.ngram_accepted,
                             ngram_shared_drafted_tokens_total=s.ngram_shared_drafted,
                             ngram_shared_accepted_tokens_total=s.ngram_shared_accepted)
        self.metrics.set(last_tokens_per_second=stats.tokens_per_s,
                         kv_cache_bytes=sum(slot.session.kv_cache_bytes for slot in self.slots))


def extension(worker: EngineWorker, result: JobResult) -> dict:
    """The response's ``sparsespec`` object: what only this engine knows about the run."""
    policy = worker.cache.policy
    out = {
        "evicted_tokens": result.stats.evicted_tokens,
        "conversation_evicted_tokens": result.conversation_evicted_tokens,
        "reused_prompt_tokens": result.stats.reused_tokens,
        "cache_policy": policy.name,
        "cache_budget": policy.budget,
        "positions": worker.cache.positions,
        "kv_cache_bytes": result.stats.kv_cache_bytes,
        "queue_seconds": round(result.queue_seconds, 4),
        "time_to_first_text_seconds": round(result.first_text_seconds, 4),
        "tokens_per_s": round(result.stats.tokens_per_s, 3),
    }
    if result.stats.speculative is not None:
        s = result.stats.speculative
        out.update(acceptance_rate=round(s.acceptance_rate, 4),
                   tokens_per_target_pass=round(s.tokens_per_target_pass, 4), gamma=result.stats.final_gamma,
                   drafted_tokens=s.drafted, accepted_tokens=s.accepted, ngram_drafted_tokens=s.ngram_drafted,
                   ngram_accepted_tokens=s.ngram_accepted, ngram_shared_drafted_tokens=s.ngram_shared_drafted,
                   ngram_shared_accepted_tokens=s.ngram_shared_accepted)
    return out
