"""The engine worker: one thread that runs generation requests one at a time, in arrival order, from a bounded queue.

The thread owns the model and a :class:`~sparsespec.engine.Session`, so a request whose prompt extends the previous
request's text (the next turn of a chat) resumes from the cache that request left. Results travel back to the
asyncio event loop as events on a per-job :class:`asyncio.Queue`; the loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from ..engine import CacheOptions, DraftOptions, RunStats, Session, check_fits_context
from ..errors import UserError
from ..generate import stream_text
from ..loading.load import LoadedModel
from ..loading.tokenizer import eos_token_ids
from ..sampling import SamplingParams

log = logging.getLogger("sparsespec.serve")

# The first text of a job goes to the event loop at once; after that at most once per interval, with every piece
# decoded meanwhile. Each hand-over wakes the event loop's thread, which then competes with the engine's threads
# for the cores: once per token it cost a fast model ~10% of its speed, once per 25 ms it costs nothing
# measurable, and a model slower than 40 tok/s still hands over every token as it comes.
TEXT_INTERVAL_SECONDS = 0.025


class QueueFull(Exception):
    """The bounded queue holds as many waiting requests as it may."""


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, in token ids. ``seed`` None draws a random one."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None = None
    stop: tuple[str, ...] = ()


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
        "prompt_tokens_total": "prompt tokens of finished requests",
        "reused_prompt_tokens_total": "prompt tokens resumed from the cache instead of read again",
        "generated_tokens_total": "tokens generated",
        "evicted_tokens_total": "KV entries evicted (per layer and head) by the target's cache",
        "drafted_tokens_total": "tokens proposed by the draft",
        "accepted_tokens_total": "draft tokens the target accepted",
        "target_passes_total": "target forward passes of speculative decoding",
    }
    GAUGES = {
        "last_tokens_per_second": "decode speed of the last finished request",
        "kv_cache_bytes": "bytes of the key and value buffers",
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


class _Counted:
    """A token stream that stops when its job is cancelled and remembers whether it ran to its end."""

    def __init__(self, tokens: Iterator[int], job: Job):
        self.tokens, self.job = tokens, job
        self.exhausted = False

    def __iter__(self) -> Iterator[int]:
        for token in self.tokens:
            yield token
            if self.job.cancelled.is_set():
                return
        self.exhausted = True


def check_worker_options(cache: CacheOptions, queue_size: int, no_evict_overflow: bool) -> None:
    """Raise :class:`UserError` for a queue bound below 1, or ``--no-evict-overflow`` where it would do nothing."""
    if queue_size < 1:
        raise UserError(f"--queue-size must be at least 1 (got {queue_size}).")
    if no_evict_overflow and (cache.policy.is_full or cache.positions == "original"):
        raise UserError(
            "--no-evict-overflow only matters with a budgeted policy and --positions in-cache; "
            "other caches refuse an overlong prompt anyway."
        )


class EngineWorker:
    """The single engine thread, its bounded queue and the conversation state (one :class:`Session`).

    ``no_evict_overflow``: refuse a request that would run past the model's context even where the budgeted cache
    (with in-cache positions) could go on by evicting.
    """

    def __init__(
        self,
        target: LoadedModel,
        cache: CacheOptions,
        draft: DraftOptions | None = None,
        *,
        queue_size: int = 16,
        no_evict_overflow: bool = False,
    ) -> None:
        check_worker_options(cache, queue_size, no_evict_overflow)
        self.target = target
        self.cache = cache
        self.draft = draft
        self.no_evict_overflow = no_evict_overflow
        self.context = target.config.max_position_embeddings
        self.session = Session(target, cache, draft, capacity=self.context)
        self.eos_ids = frozenset(eos_token_ids(target.tokenizer))
        self.metrics = Metrics()
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._serve, name="sparsespec-engine", daemon=True)
        self._current: Job | None = None  # the job the thread is running

    # ------------------------------------------------------------------------------------- event-loop side
    def start(self) -> None:
        """Run the engine in a thread of its own."""
        self._thread.start()

    def run(self) -> None:
        """Run the engine on the calling thread until :meth:`stop`."""
        self._serve()

    def stop(self) -> None:
        """Cancel the running job (it ends after its current step), drop the waiting ones and end the engine's
        loop (joining its thread, if it has one)."""
        if self._current is not None:
            self._current.cancel()
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
        check_fits_context(self.target, self.cache, total, "The prompt plus max_tokens")
        if self.draft is not None:
            check_fits_context(self.draft.model, self.draft.cache, total, "The prompt plus max_tokens (for the draft)")

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
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                self.metrics.add(requests_cancelled_total=1)
                continue
            self._current = job
            self._run(job)
            self._current = None

    def _run(self, job: Job) -> None:
        request = job.request
        started = time.perf_counter()
        stats = RunStats()
        seed = request.seed if request.seed is not None else random.getrandbits(63)
        tokens = self.session.run(
            request.prompt_ids, max_new_tokens=request.max_tokens, sampling=request.sampling, seed=seed,
            eos_ids=self.eos_ids, stats=stats,
        )
        counted = _Counted(tokens, job)
        first_text = None
        pending: list[str] = []
        handed_over = 0.0

        def hand_over() -> None:
            if pending:
                job.emit("text", "".join(pending))
                pending.clear()

        try:
            for piece in stream_text(counted, self.target.tokenizer, stop_strings=request.stop, eos_ids=self.eos_ids):
                now = time.perf_counter()
                if first_text is None:
                    first_text = now - started
                pending.append(piece)
                if now - handed_over >= TEXT_INTERVAL_SECONDS:
                    hand_over()
                    handed_over = now
        except UserError as exc:
            hand_over()
            self.metrics.add(request_errors_total=1)
            job.emit("error", (400, str(exc)))
            return
        except Exception as exc:  # the server stays up; this request ends with an error
            log.exception("generation failed")
            hand_over()
            self.metrics.add(request_errors_total=1)
            job.emit("error", (500, f"Generation failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            tokens.close()  # the session records where its arenas stopped
        hand_over()
        if job.cancelled.is_set():
            self.metrics.add(requests_cancelled_total=1)
        self._count(stats)
        job.emit("done", JobResult(
            finish_reason="length" if counted.exhausted else "stop",
            stats=stats,
            queue_seconds=started - job.submitted_at,
            first_text_seconds=first_text if first_text is not None else time.perf_counter() - started,
            conversation_evicted_tokens=self.session.evicted_tokens,
        ))

    def _count(self, stats: RunStats) -> None:
        self.metrics.add(requests_total=1, prompt_tokens_total=stats.prompt_tokens,
                         reused_prompt_tokens_total=stats.reused_tokens, generated_tokens_total=stats.new_tokens,
                         evicted_tokens_total=stats.evicted_tokens)
        if stats.speculative is not None:
            s = stats.speculative
            self.metrics.add(drafted_tokens_total=s.drafted, accepted_tokens_total=s.accepted,
                             target_passes_total=s.target_passes)
        self.metrics.set(last_tokens_per_second=stats.tokens_per_s, kv_cache_bytes=stats.kv_cache_bytes)


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
                   tokens_per_target_pass=round(s.tokens_per_target_pass, 4), gamma=result.stats.final_gamma)
    return out
