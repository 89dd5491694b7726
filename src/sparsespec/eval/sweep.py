"""The trade-off study: a grid of cache settings, each measured for quality, speed and/or retrieval, one JSON line
per point.

Grid
    The points are the product policy × KV dtype × budget × position mode × retention × draft × γ, with the axes
    that do not apply collapsed: the full cache has no budget and one position mode (``original``; with nothing
    evicted the modes coincide), a policy without heavy hitters (full, window, streaming) has no retention to switch
    (its points are ``auto``, which is off for it), and a point without a draft has no γ. Retention ``query`` is
    what ``auto`` does for a heavy-hitter policy, so such points are ``auto`` too. A draft entry is ``self``, a
    model reference, or either with ``:BUDGET`` appended (``self:64``), which overrides the draft cache's budget
    for that entry. Budgets may instead be given as KV bytes (``--kv-bytes``): each (policy, KV dtype) then gets
    the budget whose quality arena (budget + one chunk of staging) fits those bytes, and speed runs use that budget
    too.

Evaluation (injectable)
    :func:`run_grid` calls ``evaluate(point) -> dict`` for every point not yet in the output file. The real
    evaluator, :class:`SweepEvaluator`, measures

    - ``quality``: streaming perplexity of a text (see ``perplexity.py``) for the target with the point's cache
      (independent of draft, γ and retention, which has no prompt end to choose at in one stream, so it is computed
      once per cache and reused),
    - ``speed``: greedy :func:`~sparsespec.engine.run_generation` over the prompt set (EOS ignored, so every
      prompt yields exactly the requested number of new tokens), optionally after a long context taken from the
      text: tokens per second, acceptance, tokens per target pass, KV bytes, per prompt kind and overall, and/or
    - ``retrieval``: the needle check (see ``needle.py``): a greedy answer, with the point's target cache and
      draft, to every prompt of a lengths × depths grid whose haystack is the text; how many were right.

Output file (``.jsonl``, appended one line per finished point, flushed immediately)
    Each line is an object with :data:`RECORD_FIELDS`:

    ``key``           stable identity of the point: its axes plus ``setup_id``
    ``setup_id``      short hash of ``setup``
    ``setup``         everything besides the axes that changes the numbers (model, dtype, text, token counts, …)
    ``policy``, ``budget``, ``positions``, ``draft``, ``gamma``, ``kv_dtype``, ``kv_bytes``, ``retention``
                      the point's axes (``budget``/``draft``/``gamma``/``kv_bytes`` may be null; records written
                      before the retention axis have no ``retention`` and are read as ``auto``)
    ``cache``         the target cache's description, e.g. ``hybrid(sinks=4, heavy=126, window=126)``
    ``quality``       null or ``{ppl, mean_nll, predicted_tokens, window, window_ppl, tokens, chunk,
                      kv_cache_bytes, kv_metadata_bytes, evicted_tokens, seconds, tokens_per_s}``
    ``speed``         null or ``{prompts, prompt_tokens, new_tokens, tokens_per_s, prefill_seconds,
                      decode_seconds, kv_cache_bytes, kv_peak_bytes, by_kind}`` plus, with a draft, ``acceptance_rate``,
                      ``tokens_per_target_pass``, ``draft_target_cost_ratio``, ``target_passes``
    ``retrieval``     null or ``{task, lengths, depths, cells, correct, fraction, by_length}``: the needle task,
                      the prompt lengths (tokens) and depths (percent) asked, questions asked (``cells``) and
                      answered right (``correct``), their ratio, and ``by_length`` ``{"LENGTH": {cells, correct,
                      fraction}}``; with ``--retrieval-turns`` also ``by_turn`` ``{"TURN": {...}}``
    ``rss_bytes``     resident memory of the process after the point (psutil)
    ``rss_peak_bytes`` highest resident memory sampled while the point ran
    ``seconds``       wall time of the point; ``finished_at`` ISO time stamp

Resuming
    Points whose ``key`` is already in the file are skipped, so an interrupted sweep continues where it stopped; a
    different setup (another model, text length, …) gets different keys and is measured afresh. A line cut short
    by an interruption is removed from the file and its point measured again.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import itertools
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from ..errors import ConfigError, UserError
from ..speedup import DEFAULT_GAMMA

if TYPE_CHECKING:  # needle.py imports torch, which only a run needs
    from .needle import NeedleSetup

RECORD_FIELDS = (
    "key", "setup_id", "setup", "policy", "budget", "positions", "draft", "gamma", "kv_dtype", "kv_bytes",
    "retention", "cache", "quality", "speed", "retrieval",
    "rss_bytes", "rss_peak_bytes", "seconds", "finished_at",
)


# ---------------------------------------------------------------------------------------------------- grid
@dataclass(frozen=True)
class SweepPoint:
    """One cell of the grid. ``budget`` is None for the full cache; ``draft``/``gamma`` None without a draft."""

    policy: str
    budget: int | None
    positions: str
    draft: str | None = None
    gamma: int | str | None = None
    kv_dtype: str = "auto"
    kv_bytes: int | None = None  # the bytes the budget was sized for, when the grid was given in bytes
    retention: str = "auto"  # auto (query-aware where the policy keeps heavy hitters) | off, see cache/retention.py

    def key(self, setup_id: str) -> str:
        parts = [
            self.policy,
            f"budget={self.budget if self.budget is not None else '-'}",
            f"positions={self.positions}",
            f"draft={self.draft or '-'}",
            f"gamma={self.gamma if self.gamma is not None else '-'}",
        ]
        if self.kv_dtype != "auto":  # absent from keys written before KV dtypes existed
            parts.append(f"kv={self.kv_dtype}")
        if self.kv_bytes is not None:
            parts.append(f"kv_bytes={self.kv_bytes}")
        if self.retention != "auto":  # absent from keys written before the retention axis
            parts.append(f"retention={self.retention}")
        return "|".join(parts + [f"setup={setup_id}"])

    def label(self) -> str:
        text = self.policy if self.budget is None else f"{self.policy}@{self.budget}/{self.positions}"
        if self.kv_dtype != "auto":
            text += f" KV {self.kv_dtype}"
        if self.retention != "auto":
            text += f" retention {self.retention}"
        if self.draft:
            text += f" draft={self.draft} γ={self.gamma}"
        return text


def split_list(text: str | None) -> list[str]:
    """``"a, b,,c"`` → ``["a", "b", "c"]``."""
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def parse_draft(entry: str) -> tuple[str, int | None]:
    """``self`` → (``self``, None); ``self:64`` → (``self``, 64); ``model:128`` → (``model``, 128)."""
    ref, sep, tail = entry.rpartition(":")
    if sep and tail.isdigit() and ref:
        budget = int(tail)
        if budget < 1:
            raise UserError(f"The draft budget in {entry!r} must be at least 1.")
        return ref, budget
    return entry, None


def build_grid(
    policies: Sequence[str],
    budgets: Sequence[int],
    positions: Sequence[str],
    gammas: Sequence[int | str] = (DEFAULT_GAMMA,),
    drafts: Sequence[str | None] = (None,),
    kv_dtypes: Sequence[str] = ("auto",),
    kv_bytes: Sequence[int] = (),
    budget_for_bytes: Callable[[str, str, int], int] | None = None,
    retentions: Sequence[str] = ("auto",),
) -> list[SweepPoint]:
    """All points of the grid, in a fixed order, with inapplicable axes collapsed and duplicates dropped.

    Every budgeted point is checked with :func:`make_policy`, so a budget too small for a policy fails before
    anything runs. With ``kv_bytes``, ``budgets`` must be empty and ``budget_for_bytes(policy, kv_dtype, nbytes)``
    gives each budget. ``retentions`` are ``--retention`` modes; a point's is ``off`` only where that was asked and
    its policy keeps heavy hitters, else ``auto``.
    """
    from ..cache.arena import POSITION_MODES
    from ..cache.policy import make_policy
    from ..cache.retention import RETENTION_MODES

    if not policies:
        raise ConfigError("{policies} is empty; give at least one of full, window, streaming, h2o, hybrid, "
                          "hybrid-age, hybrid-decay.")
    for mode in positions:
        if mode not in POSITION_MODES:
            raise UserError(f"Unknown position mode {mode!r}; choose original and/or in-cache.")
    if kv_bytes and budgets:
        raise ConfigError("Give the budgets either as {budgets} or as {kv_bytes}, not both.")
    if any(p != "full" for p in policies) and not budgets and not kv_bytes:
        raise ConfigError("{budgets} is empty; a budgeted policy needs at least one budget.")
    if not kv_dtypes:
        raise ConfigError("{kv_dtypes} is empty; give at least one of auto, bf16, int8, int4.")
    if not positions:
        raise ConfigError("{positions} is empty; give original and/or in-cache.")
    if not retentions:
        raise ConfigError("{retentions} is empty; give auto and/or off.")
    for mode in retentions:
        if mode not in RETENTION_MODES:
            raise ConfigError("Unknown retention {value!r} in {retentions}; choose auto and/or off.", value=mode)
    drafts = list(drafts) or [None]
    gammas = list(gammas) or [DEFAULT_GAMMA]
    points: dict[SweepPoint, None] = {}
    sizes = [(b, None) for b in budgets] or [(None, n) for n in kv_bytes] or [(None, None)]
    for policy, kv, (budget, nbytes), mode, retention, draft, gamma in itertools.product(
        policies, kv_dtypes, sizes, positions, retentions, drafts, gammas
    ):
        if policy == "full":
            budget, nbytes, mode = None, None, "original"
        elif nbytes is not None:
            budget = budget_for_bytes(policy, kv, nbytes)
        keeps_heavy_hitters = make_policy(policy, budget).needs_scores  # also fails a budget too small now
        if retention != "off" or not keeps_heavy_hitters:
            retention = "auto"  # query is auto's choice for heavy hitters; without them every mode is off
        if draft is None:
            gamma = None
        points.setdefault(SweepPoint(policy, budget, mode, draft, gamma, kv, nbytes, retention))
    return list(points)


def setup_id(setup: Mapping) -> str:
    """A short stable hash of the run settings (sorted JSON)."""
    return hashlib.sha1(json.dumps(setup, sort_keys=True, default=str).encode()).hexdigest()[:10]


# ---------------------------------------------------------------------------------------------- the file
def _parse_record(line: str) -> dict | None:
    """The record on one line of a sweep file, or None for a blank, broken or foreign line."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "key" in record else None


def read_records(path: str | Path) -> list[dict]:
    """Every complete JSON object line of a sweep file (a missing file has none; broken lines are skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = (_parse_record(line) for line in path.read_text(encoding="utf-8").splitlines())
    return [r for r in records if r is not None]


def _drop_broken_lines(path: Path) -> None:
    """Rewrite ``path`` without lines that are not complete records (left by an interrupted write), if any."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    good = [line for line in lines if _parse_record(line) is not None]
    if len(good) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in good), encoding="utf-8")
        tmp.replace(path)


def _append_line(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        f.seek(0, 2)
        if f.tell():
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")  # close a line that an interruption cut short
        f.write((json.dumps(record) + "\n").encode("utf-8"))
        f.flush()


# ------------------------------------------------------------------------------------------------- memory
class RssMonitor:
    """Samples the process's resident memory in a background thread while a ``with`` block runs."""

    def __init__(self, interval_s: float = 0.02) -> None:
        import psutil

        self._process = psutil.Process()
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        rss = self._process.memory_info().rss
        self.peak = max(self.peak, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "RssMonitor":
        self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.current = self.sample()


# ----------------------------------------------------------------------------------------------- running
Evaluator = Callable[[SweepPoint], dict]


def run_grid(
    points: Iterable[SweepPoint],
    out: str | Path,
    evaluate: Evaluator,
    setup: Mapping,
    on_record: Callable[[dict, bool], None] | None = None,
) -> list[dict]:
    """Measure every point whose key is not yet in ``out``, appending one JSON line each; return this grid's records.

    ``evaluate(point)`` returns ``{"cache": str, "quality": dict | None, "speed": dict | None, "retrieval": dict |
    None}``; the rest of the record (key, setup, axes, memory, time) is added here. ``on_record(record, reused)``
    is called for every point in grid order (``reused`` is True for points found in the file).
    """
    out = Path(out)
    setup = dict(setup)
    sid = setup_id(setup)
    _drop_broken_lines(out)
    done = {r["key"]: r for r in read_records(out)}
    records = []
    for point in points:
        key = point.key(sid)
        if key in done:
            record = done[key]
            if on_record:
                on_record(record, True)
            records.append(record)
            continue
        started = time.perf_counter()
        with RssMonitor() as rss:
            result = evaluate(point)
        record = {
            "key": key,
            "setup_id": sid,
            "setup": setup,
            **asdict(point),
            "cache": result.get("cache"),
            "quality": result.get("quality"),
            "speed": result.get("speed"),
            "retrieval": result.get("retrieval"),
            "rss_bytes": rss.current,
            "rss_peak_bytes": rss.peak,
            "seconds": round(time.perf_counter() - started, 3),
            "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        _append_line(out, record)
        done[key] = record
        if on_record:
            on_record(record, False)
        records.append(record)
    return records


# --------------------------------------------------------------------------------------- the real evaluator
@dataclass(frozen=True)
class SweepOptions:
    """How :class:`SweepEvaluator` measures.

    Args:
        quality, speed: what to measure.
        retrieval: the needle check to run at every point (a ``needle.NeedleSetup``), or None for none.
        context: text read before every prompt (empty for none).
        new_tokens: new tokens per prompt (speed runs decode greedily, EOS ignored).
        answer_tokens: most new tokens of each retrieval answer (greedy, ending at end-of-sequence).
        chunk: perplexity chunk (1 = exact decoding semantics); None: 1 for budgeted caches, ``prefill_chunk`` for
            the full cache (whose perplexity does not depend on the chunk).
        window: tokens per window of the perplexity summary.
        prefill_chunk: prompt tokens per prefill pass.
        force_context: allow positions beyond the trained context.
        progress: tqdm bar while computing perplexity.
    """

    quality: bool = True
    speed: bool = True
    retrieval: NeedleSetup | None = None
    context: str = ""
    new_tokens: int = 64
    answer_tokens: int = 16
    chunk: int | None = None
    window: int = 256
    prefill_chunk: int = 512
    force_context: bool = False
    progress: bool = False


class SweepEvaluator:
    """Measures points for one loaded target model (and drafts loaded on demand).

    Args:
        target: the loaded target model.
        options: what to measure and how.
        text_ids: token ids of the quality text (needed for ``quality``), already cut to ``max_tokens``.
        prompts: the speed prompt set (needed for ``speed``).
        needle_prompts: the retrieval prompts, ``needle.build_prompts`` of ``options.retrieval`` (needed for
            ``retrieval``).
        draft_cache: ``(positions, budget override) -> CacheOptions`` of the draft.
        load_draft: ``reference -> LoadedModel`` for draft entries other than ``self``.
        answerer: ``(target, cache, draft, max_new_tokens) -> answer(prompt) -> needle.Answer``, the retrieval's
            answers (default: ``needle.engine_answerer``, greedy decoding).
    """

    def __init__(
        self,
        target,
        options: SweepOptions = SweepOptions(),
        *,
        text_ids: Sequence[int] | None = None,
        prompts: Sequence = (),
        needle_prompts: Sequence = (),
        draft_cache: Callable[[str, int | None], object] | None = None,
        load_draft: Callable[[str], object] | None = None,
        answerer: Callable | None = None,
    ) -> None:
        self.target = target
        self.options = options
        self.quality, self.speed = options.quality, options.speed
        self.text_ids = list(text_ids) if text_ids is not None else None
        self.prompts = list(prompts)
        self.needle_prompts = list(needle_prompts)
        self.draft_cache = draft_cache
        self.load_draft = load_draft
        self.answerer = answerer
        self._quality_memo: dict[tuple, dict] = {}
        self._drafts: dict[str, object] = {}
        self._prompt_ids: list[list[int]] | None = None
        self._warmed_up = False

    # -- setup
    def cache_options(self, point: SweepPoint):
        from ..cache.policy import make_policy
        from ..engine import CacheOptions

        policy = make_policy(point.policy, point.budget)
        o = self.options
        return CacheOptions(policy, point.positions, o.prefill_chunk, o.force_context, point.kv_dtype,
                            retention=point.retention)

    def remember(self, records: Iterable[dict]) -> None:
        """Reuse quality results of earlier records with the same cache (they do not depend on draft, γ or
        retention)."""
        for r in records:
            if r.get("quality"):
                memo_key = (r["policy"], r["budget"], r["positions"], r.get("kv_dtype", "auto"))
                self._quality_memo.setdefault(memo_key, r["quality"])

    def prompt_token_ids(self) -> list[list[int]]:
        from .prompts import prompt_ids

        if self._prompt_ids is None:
            self._prompt_ids = [prompt_ids(self.target.tokenizer, p, self.options.context) for p in self.prompts]
        return self._prompt_ids

    def draft(self, point: SweepPoint):
        """``DraftOptions`` for the point, or None."""
        from ..engine import DraftOptions

        if point.draft is None:
            return None
        ref, budget = parse_draft(point.draft)
        cache = self.draft_cache(point.positions, budget)
        if ref == "self":
            return DraftOptions(self.target, cache, point.gamma, is_self=True)
        if ref not in self._drafts:
            self._drafts[ref] = self.load_draft(ref)
        return DraftOptions(self._drafts[ref], cache, point.gamma)

    def check(self, point: SweepPoint) -> None:
        """Raise :class:`UserError` now for a point that could not run (context too long for its positions,
        in-cache ranks past the trained context, or int4 keys that would keep a key bias in)."""
        from ..cache.arena import check_key_storage
        from ..engine import check_fits_context, check_in_cache_ranks

        cache, o = self.cache_options(point), self.options
        check_key_storage(cache.policy, cache.positions, cache.kv_dtype, self.target.config.attention_bias)
        if self.quality and self.text_ids is not None:
            check_fits_context(self.target, cache, len(self.text_ids), "The quality text ({max_tokens})")
            chunk = o.chunk if o.chunk is not None else (o.prefill_chunk if cache.policy.is_full else 1)
            check_in_cache_ranks(self.target, cache, min(chunk, len(self.text_ids)))
        if self.speed and self.prompts:
            longest = max(len(ids) for ids in self.prompt_token_ids()) + o.new_tokens
            self._check_generation(point, cache, longest, "The longest prompt plus context and {max_new_tokens}")
        if o.retrieval is not None and self.needle_prompts:
            longest = max(len(prompt.ids) for prompt in self.needle_prompts) + o.answer_tokens
            self._check_generation(point, cache, longest, "The longest retrieval prompt plus its answer")

    def _check_generation(self, point: SweepPoint, cache, longest: int, what: str) -> None:
        """:meth:`check` for greedy runs of up to ``longest`` tokens (prompt and new ones, named ``what`` in the
        error) through ``cache`` and the point's draft."""
        from ..cache.arena import check_key_storage
        from ..engine import check_fits_context, check_in_cache_ranks
        from ..speculative import GAMMA_MAX, draft_inflight_rows, target_inflight_rows

        check_fits_context(self.target, cache, longest, what)
        draft = self.draft(point)
        gamma_cap = GAMMA_MAX if point.gamma == "auto" else (point.gamma or 0)
        staging = min(self.options.prefill_chunk, longest)
        check_in_cache_ranks(self.target, cache, max(staging, target_inflight_rows(gamma_cap) if draft else 1))
        if draft is not None:
            check_key_storage(draft.cache.policy, draft.cache.positions, draft.cache.kv_dtype,
                              draft.model.config.attention_bias)
            check_fits_context(draft.model, draft.cache, longest, f"{what} (for the draft)")
            check_in_cache_ranks(draft.model, draft.cache, max(staging, draft_inflight_rows(gamma_cap)))

    # -- measuring
    def __call__(self, point: SweepPoint) -> dict:
        cache = self.cache_options(point)
        result = {"cache": cache.policy.describe(), "quality": None, "speed": None, "retrieval": None}
        if self.quality and self.text_ids is not None:
            memo_key = (point.policy, point.budget, point.positions, point.kv_dtype)
            if memo_key not in self._quality_memo:
                from .perplexity import measure_perplexity

                o = self.options
                chunk = o.chunk if o.chunk is not None else (o.prefill_chunk if cache.policy.is_full else 1)
                _, summary = measure_perplexity(self.target, cache, self.text_ids, chunk, o.window, progress=o.progress)
                self._quality_memo[memo_key] = summary
            result["quality"] = self._quality_memo[memo_key]
        if self.speed and self.prompts:
            result["speed"] = self.measure_speed(point, cache)
        if self.options.retrieval is not None and self.needle_prompts:
            result["retrieval"] = self.measure_retrieval(point, cache)
        return result

    def measure_retrieval(self, point: SweepPoint, cache) -> dict:
        """:func:`retrieval_summary` of the needle prompts, each answered greedily by the target with ``cache``
        (the point's ``CacheOptions``) and the point's draft (every key in turns of a conversation with
        ``turns``)."""
        from .needle import engine_answerer, run_needle_grid, turns_answerer

        o = self.options
        default = turns_answerer if o.retrieval.turns else engine_answerer
        answer = (self.answerer or default)(self.target, cache, self.draft(point), o.answer_tokens)
        records = run_needle_grid(self.needle_prompts, answer, o.retrieval, {}, progress=o.progress)
        return retrieval_summary(o.retrieval.task, records)

    def measure_speed(self, point: SweepPoint, cache) -> dict:
        from ..engine import RunStats, run_generation
        from ..sampling import SamplingParams

        draft = self.draft(point)
        if not self._warmed_up:
            # One short untimed run first, so one-time start-up costs (kernel selection, allocator growth) do not
            # land on the first point's numbers.
            for _ in run_generation(self.target, self.prompt_token_ids()[0], max_new_tokens=2,
                                    sampling=SamplingParams(0.0), cache=cache, eos_ids=frozenset(), draft=draft):
                pass
            self._warmed_up = True
        per_kind: dict[str, list[RunStats]] = {}
        for prompt, ids in zip(self.prompts, self.prompt_token_ids()):
            stats = RunStats()
            for _ in run_generation(
                self.target, ids, max_new_tokens=self.options.new_tokens, sampling=SamplingParams(0.0),
                cache=cache, eos_ids=frozenset(), draft=draft, stats=stats,
            ):
                pass
            per_kind.setdefault(prompt.kind, []).append(stats)
        everything = [s for runs in per_kind.values() for s in runs]
        summary = aggregate_stats(everything)
        summary["by_kind"] = {kind: aggregate_stats(runs) for kind, runs in per_kind.items()}
        return summary


def retrieval_summary(task: str, records: Sequence[Mapping]) -> dict:
    """A point's ``retrieval`` field from its needle records (``needle.needle_record``): ``task``, the ``lengths``
    and ``depths`` asked, ``cells`` (questions: prompts, or their turns), ``correct`` (right answers), ``fraction``
    (their ratio), ``by_length`` ``{"LENGTH": {cells, correct, fraction}}`` (keys as JSON writes them) and, for
    questions asked in turns, ``by_turn`` ``{"TURN": {cells, correct, fraction}}`` (the first turn "1")."""
    from .needle import score_grid, score_turns

    grid = score_grid(records)
    tally: dict[int, tuple[int, int]] = {}
    for (length, _), (correct, total) in grid.cells.items():
        right, cells = tally.get(length, (0, 0))
        tally[length] = (right + correct, cells + total)

    def score(correct: int, cells: int) -> dict:
        return {"cells": cells, "correct": correct, "fraction": round(correct / cells, 4) if cells else 0.0}

    summary = {"task": task, "lengths": grid.lengths, "depths": grid.depths, **score(grid.correct, grid.total),
               "by_length": {str(length): score(*tally[length]) for length in grid.lengths}}
    turns = score_turns(records)
    if len(turns) > 1:
        summary["by_turn"] = {str(turn + 1): score(*tally) for turn, tally in turns.items()}
    return summary


def aggregate_stats(runs: Sequence) -> dict:
    """Totals over several :class:`~sparsespec.engine.RunStats`: speeds are total tokens over total time."""
    new = sum(s.new_tokens for s in runs)
    decode = sum(s.decode_seconds for s in runs)
    out = {
        "prompts": len(runs),
        "prompt_tokens": sum(s.prompt_tokens for s in runs),
        "new_tokens": new,
        "tokens_per_s": round(new / decode, 3) if decode > 0 else 0.0,  # as RunStats.tokens_per_s
        "prefill_seconds": round(sum(s.prefill_seconds for s in runs), 4),
        "decode_seconds": round(decode, 4),
        "kv_cache_bytes": max((s.kv_cache_bytes for s in runs), default=0),
        "kv_peak_bytes": max((s.kv_peak_bytes for s in runs), default=0),  # retention's whole-prompt hold
    }
    spec = [s.speculative for s in runs if s.speculative is not None]
    if spec:
        from ..speculative import cost_ratio

        drafted = sum(s.drafted for s in spec)
        passes = sum(s.target_passes for s in spec)
        draft_s = sum(s.draft_seconds for s in spec)
        target_s = sum(s.target_seconds for s in spec)
        out.update(
            acceptance_rate=round(sum(s.accepted for s in spec) / drafted, 4) if drafted else 0.0,
            tokens_per_target_pass=round(sum(s.new_tokens for s in spec) / passes, 4) if passes else 0.0,
            target_passes=passes,
            draft_target_cost_ratio=round(cost_ratio(draft_s, drafted, target_s, passes), 4),
        )
    return out


# ------------------------------------------------------------------------------------------------- plots
def _series_label(record: dict, with_draft: bool, with_retention: bool = True) -> str:
    """The plot series a record belongs to: policy, positions, KV dtype, and retention and the draft where the
    plotted number depends on them."""
    label = record["policy"] if record["policy"] == "full" else f"{record['policy']} ({record['positions']})"
    if record.get("kv_dtype", "auto") != "auto":
        label += f", KV {record['kv_dtype']}"
    if with_retention and record.get("retention", "auto") != "auto":
        label += f", retention {record['retention']}"
    if with_draft and record.get("draft"):
        label += f", draft {record['draft']} γ={record['gamma']}"
    return label


def _draw(path: Path, title: str, xlabel: str, ylabel: str, series: dict, flat: dict, log_x: str | bool,
          log_y: bool = False, y_range: tuple[float, float] | None = None) -> Path:
    """One figure: lines for ``series`` ({label: [(x, y)]}) and dashed horizontal lines for ``flat`` ({label: y}).

    ``log_x="budget"`` draws a base-2 axis ticked at the budgets; ``True`` a plain log axis. ``log_y`` draws a log
    y axis (perplexities, which span a collapsing window-only cache and the full cache). ``y_range`` fixes the y
    axis (fractions: 0 to 1, even where every point is 1).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in series.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    for i, (label, y) in enumerate(flat.items()):
        ax.axhline(y, linestyle="--", linewidth=1, color=f"C{(len(series) + i) % 10}", label=label)
    xs = sorted({x for pts in series.values() for x, _ in pts})
    if log_x == "budget" and xs and xs[0] > 0:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
    elif log_x and xs and xs[0] > 0:
        _log_axis_in_plain_numbers(ax.xaxis, ax.set_xscale)
    if log_y:
        _log_axis_in_plain_numbers(ax.yaxis, ax.set_yscale)
    if y_range is not None:
        ax.set_ylim(*y_range)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if series or flat:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _log_axis_in_plain_numbers(axis, set_scale: Callable[[str], None]) -> None:
    """A log scale whose ticks read 68, 70, 72 rather than 6.8×10¹ (a narrow range shows only minor ticks)."""
    from matplotlib.ticker import FuncFormatter

    set_scale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(plain)


def plot_sweep(records: Sequence[dict], folder: str | Path) -> list[Path]:
    """Draw the trade-off plots that ``records`` have data for into ``folder``; return the files written.

    ``ppl_vs_budget.png`` (perplexity per policy), ``tokps_vs_budget.png`` (decode speed),
    ``acceptance_vs_budget.png`` (acceptance against the target's budget, runs with a draft) and
    ``ppl_vs_kv_bytes.png`` (perplexity against the bytes of the KV buffers), ``ppl_gap_vs_position.png`` (how
    far each hybrid cache's windowed perplexity lies above the full cache's along the text) and
    ``retrieval_vs_budget.png`` (fraction of needle questions answered right, per policy and retention). The full
    cache appears as a dashed line: it has no budget, and in the bytes plot it is the quality every budget aims at.
    Perplexity does not depend on retention, so its series do not split by it.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []

    def collect(metric: Callable[[dict], float | None], with_draft: bool, x_of=lambda r: r["budget"],
                with_retention: bool = True):
        series: dict[str, dict] = {}
        flat: dict[str, float] = {}
        for r in records:
            y = metric(r)
            if y is None:
                continue
            label = _series_label(r, with_draft, with_retention)
            if r["policy"] == "full":
                flat.setdefault(label, y)
            else:
                series.setdefault(label, {}).setdefault(x_of(r), y)
        return {k: list(v.items()) for k, v in series.items()}, flat

    def kv_mib(r):
        nbytes = (r.get("quality") or {}).get("kv_cache_bytes")
        return None if nbytes is None else nbytes / 2**20

    def quality(key):
        return lambda r: (r.get("quality") or {}).get(key)

    def speed(key, draft_only=False):
        return lambda r: None if draft_only and not r.get("draft") else (r.get("speed") or {}).get(key)

    def retrieval(r):
        return (r.get("retrieval") or {}).get("fraction")

    plots = [
        ("ppl_vs_budget.png", "Perplexity vs KV budget", "budget (tokens per layer and KV head)", "perplexity",
         *collect(quality("ppl"), False, with_retention=False), "budget"),
        ("tokps_vs_budget.png", "Decode speed vs KV budget", "budget (tokens per layer and KV head)", "tokens / s",
         *collect(speed("tokens_per_s"), True), "budget"),
        ("acceptance_vs_budget.png", "Draft acceptance vs target KV budget", "target budget (tokens)",
         "acceptance rate", *collect(speed("acceptance_rate", draft_only=True), True), "budget"),
        ("ppl_vs_kv_bytes.png", "Perplexity vs KV cache memory", "KV cache MiB (keys + values, all layers)",
         "perplexity", *collect(quality("ppl"), False, x_of=kv_mib, with_retention=False), True),
        (RETRIEVAL_PLOT, "Needle retrieval vs KV budget", "budget (tokens per layer and KV head)",
         "fraction answered right", *collect(retrieval, False), "budget"),
    ]
    gap = _hybrid_gap_along_text(records)
    if gap:
        window, series = gap
        plots.append(("ppl_gap_vs_position.png", "Hybrid cache: perplexity above the full cache along the text",
                      "token position", f"% above full (per {window}-token window, trailing mean of {GAP_SMOOTHING})",
                      series, {"full cache": 0.0}, False))
    for name, title, xlabel, ylabel, series, flat, log_x in plots:
        if series or flat:
            fraction = (0, 1.02) if name == RETRIEVAL_PLOT else None
            written.append(_draw(folder / name, title, xlabel, ylabel, series, flat, log_x,
                                 log_y=name.startswith("ppl_vs"), y_range=fraction))
    return written


RETRIEVAL_PLOT = "retrieval_vs_budget.png"


GAP_SMOOTHING = 4  # windows averaged per point of the gap plot


def _hybrid_gap_along_text(records: Sequence[dict], smooth: int = GAP_SMOOTHING) -> tuple[int, dict] | None:
    """Per hybrid point, the % by which its windowed perplexity exceeds the full cache's, against position.

    Returns ``(window, {label: [(last token position of the window, % gap)]})``, each gap a trailing mean over
    ``smooth`` windows, or None without a full-cache record that has a ``window_ppl`` curve. Shows whether a fixed
    budget costs more the further the model could otherwise look back.
    """
    curves = {}
    for r in records:
        q = r.get("quality") or {}
        if q.get("window_ppl") and r["policy"] in ("full", "hybrid"):
            label = "full" if r["policy"] == "full" else f"{r['policy']} {r['budget']} ({r['positions']})"
            if r["policy"] != "full" and r.get("kv_dtype", "auto") != "auto":
                label += f", KV {r['kv_dtype']}"
            curves.setdefault(label, (q["window"], q["window_ppl"]))
    full = curves.pop("full", None)
    if full is None or not curves:
        return None
    window, reference = full
    series = {}
    for label, (_, curve) in curves.items():
        gaps = [100 * (ours / theirs - 1) for theirs, ours in zip(reference, curve)]
        series[label] = [((i + 1) * window, sum(gaps[max(0, i - smooth + 1): i + 1]) / min(i + 1, smooth))
                         for i in range(len(gaps))]
    return window, series


def describe_record(record: dict) -> str:
    """A one-line human summary of a record (what the CLI prints per point)."""
    parts = [SweepPoint(record["policy"], record["budget"], record["positions"], record["draft"],
                        record["gamma"], record.get("kv_dtype", "auto"),
                        retention=record.get("retention", "auto")).label()]
    q, s, n = record.get("quality"), record.get("speed"), record.get("retrieval")
    if q:
        parts.append(f"ppl {q['ppl']:.3f}")
        parts.append(f"kv {q['kv_cache_bytes'] / 2**20:.1f} MiB")
    if s:
        parts.append(f"{s['tokens_per_s']:.1f} tok/s")
        if "acceptance_rate" in s:
            parts.append(f"acc {s['acceptance_rate']:.2f}, {s['tokens_per_target_pass']:.2f} tok/pass")
    if n:
        parts.append(f"retrieval {n['correct']}/{n['cells']} ({n['fraction']:.0%})")
    parts.append(f"peak rss {record['rss_peak_bytes'] / 2**20:.0f} MiB")
    return ", ".join(parts)


def log_record(record: dict, reused: bool) -> None:
    print(("[kept] " if reused else "") + describe_record(record), file=sys.stderr, flush=True)
