"""The needle-in-a-haystack retrieval check: does a KV cache still answer a question about something stated once?

Prompts
    Each cell of the grid (context length × depth × trial) gets one prompt of the requested length in the model's
    tokens, the whole prompt counted (chat template and special tokens included)::

        INTRO

        <haystack text, with the needle sentence(s) planted on lines of their own>

        <question>

    wrapped in the tokenizer's chat template as one user message (``chat``), or followed by ``Answer:`` as plain
    text. The haystack is a run of a long text (:class:`Haystack`) starting at a seed-chosen line; the needle the
    question asks about goes in at ``depth`` percent of the haystack's tokens, moved to the nearest line (or
    sentence) boundary; the haystack is then trimmed until the whole prompt has the requested number of tokens
    (:func:`build_prompt`; it ends a few tokens short at most where the tokenizer merges across the cut).

Tasks
    ``passkey``   one five-digit passkey, stated twice in one sentence; asked for the number.
    ``multikey``  ``keys`` passkeys, each for a differently named lock ("the passkey for the blue door is …"): the
                  one asked about at the cell's depth, the others at seed-chosen depths; asked for one number.
    ``fact``      one made-up fact from :data:`FACTS` ("The lighthouse keeper on Varrin Island was named …");
                  asked for the name.

    With ``turns`` (multikey only, chat prompts), every passkey is asked, one per turn of one conversation: the
    prompt asks for the key at the cell's depth, each later turn (a new user message after the model's answer) for
    another key, in the order the keys were drawn. The conversation runs through one session
    (:class:`~sparsespec.engine.Session`), as ``chat`` and ``serve`` hold one, so a budgeted cache answers later
    questions from what it kept after the earlier turns: the second question is the one a prompt's selection could
    not see coming.

    Every random choice of a cell (the passkeys, the fact, the lock names, the other keys' depths, where the
    haystack starts) comes from :func:`cell_rng`, seeded by the run's seed and the cell, so a run is reproducible
    and cells do not depend on which other cells the grid has.

Scoring
    :func:`answer_is_correct`: the expected number or name appears in the answer as a whole word, ignoring case.

Running
    :func:`run_needle_grid` asks an injectable ``answer(prompt) -> Answer`` (a list of them, one per turn, with
    ``turns``) for every prompt and returns one record per cell and turn (:func:`needle_record`);
    :func:`engine_answerer` is the real one (greedy decoding through :func:`~sparsespec.engine.run_generation`),
    :func:`turns_answerer` its multi-turn twin (a :class:`~sparsespec.engine.Session` per cell).
    :func:`summary_table` and :func:`plot_heatmap` show the records as a length × depth table of correct answers.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
import re
import sys
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from ..engine import RunStats
from ..errors import ConfigError, UserError

TASKS = ("passkey", "multikey", "fact")
DEFAULT_KEYS = 4
# The fewest haystack tokens a prompt may have: below this the "haystack" is hardly a context at all.
MIN_HAYSTACK_TOKENS = 32
# Re-trimming rounds while fitting a prompt to its length: each corrects the haystack by the tokens the prompt was
# off, which after the first round is a token or two (the tokenizer merging across the cut); the closest prompt not
# over the length is kept.
FIT_ROUNDS = 6
# How far (characters) a needle may move to reach a line or sentence boundary before it settles for a space.
MAX_BOUNDARY_SHIFT = 400

INTRO = ("Below is a long text. Somewhere in it is a piece of information that you will be asked about at the end; "
         "read carefully and remember it.")
PLAIN_ANSWER_CUE = "\nAnswer:"
NUMBER_ONLY = " Answer with the number only."

LOCKS = ("blue door", "red gate", "green chest", "silver box", "black safe", "white cabinet", "yellow locker",
         "brown trunk", "orange vault", "purple drawer", "grey hatch", "golden casket")


@dataclass(frozen=True)
class Fact:
    """A made-up fact stated once in the haystack, the question about it, and the name that answers it."""

    statement: str
    question: str
    answer: str


FACTS = (
    Fact("The lighthouse keeper on Varrin Island was named Oswin Tarrow.",
         "What was the name of the lighthouse keeper on Varrin Island?", "Oswin Tarrow"),
    Fact("The ship that first reached the harbour of Calder Bay was called the Marigold Wren.",
         "What was the ship that first reached the harbour of Calder Bay called?", "Marigold Wren"),
    Fact("The tower clock of Essenford was built by a clockmaker named Hedda Vornholt.",
         "Who built the tower clock of Essenford?", "Hedda Vornholt"),
    Fact("The river that runs through the valley of Tamsk is named the Orlenne.",
         "What is the name of the river that runs through the valley of Tamsk?", "Orlenne"),
    Fact("The village baker in Little Pellow kept a goat called Brisket.",
         "What was the name of the goat that the village baker in Little Pellow kept?", "Brisket"),
    Fact("The observatory on Mount Arkel was founded by Ingrid Sallow.",
         "Who founded the observatory on Mount Arkel?", "Ingrid Sallow"),
    Fact("The password to the archive of Dunmere Abbey was silver heron.",
         "What was the password to the archive of Dunmere Abbey?", "silver heron"),
    Fact("The first mayor of the mountain town of Brellin was Tobias Quarrington.",
         "Who was the first mayor of the mountain town of Brellin?", "Tobias Quarrington"),
)
ANSWER_BRIEFLY = " Answer with the name only."


# ------------------------------------------------------------------------------------------------------ setup
@dataclass(frozen=True)
class NeedleSetup:
    """What a run plants and asks: the task, the grid of lengths (tokens) × depths (percent) × trials, the seed,
    and whether prompts are wrapped in the chat template. Bad values raise :class:`ConfigError` naming the field."""

    task: str = "passkey"
    lengths: tuple[int, ...] = (1024,)
    depths: tuple[float, ...] = (0.0, 25.0, 50.0, 75.0, 100.0)
    trials: int = 1
    keys: int | None = None  # multikey only; None there means DEFAULT_KEYS
    seed: int = 0
    chat: bool = True
    turns: bool = False  # multikey only: every key asked, one per turn of one conversation

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError("Unknown {task} {value!r}; choose one of {choices}.", value=self.task,
                              choices=", ".join(TASKS))
        if not self.lengths:
            raise ConfigError("{lengths} is empty; give at least one prompt length in tokens.")
        if min(self.lengths) < 1:
            raise ConfigError("{lengths} are prompt lengths in tokens and must be positive (got {value}).",
                              value=min(self.lengths))
        if not self.depths:
            raise ConfigError("{depths} is empty; give at least one depth between 0 and 100 (percent).")
        outside = [d for d in self.depths if not 0 <= d <= 100]
        if outside:
            raise ConfigError("{depths} are percentages of the haystack, from 0 to 100 (got {value:g}).",
                              value=outside[0])
        if self.trials < 1:
            raise ConfigError("{trials} must be at least 1 (got {value}).", value=self.trials)
        if self.task != "multikey":
            if self.keys is not None:
                raise ConfigError("{keys} sets how many passkeys {task} multikey plants; drop it for {task} {value}.",
                                  value=self.task)
        elif not 2 <= self.key_count <= len(LOCKS):
            raise ConfigError("{keys} must be from 2 to {most} for {task} multikey (got {value}).", most=len(LOCKS),
                              value=self.key_count)
        if self.turns and self.task != "multikey":
            raise ConfigError("{turns} asks every passkey of {task} multikey, one per turn; use it with {task} "
                              "multikey.")
        if self.turns and not self.chat:
            raise ConfigError("{turns} holds a conversation, which needs prompts in the chat template ({chat}).")

    @property
    def key_count(self) -> int:
        """Needles per prompt: ``keys`` (default :data:`DEFAULT_KEYS`) for multikey, 1 for the other tasks."""
        if self.task != "multikey":
            return 1
        return DEFAULT_KEYS if self.keys is None else self.keys

    def cells(self) -> list[tuple[int, float, int]]:
        """``(length, depth, trial)`` of every cell, each once: lengths, then depths ascending, then trials."""
        return [(length, depth, trial) for length in sorted(set(self.lengths)) for depth in sorted(set(self.depths))
                for trial in range(self.trials)]


def cell_rng(seed: int, length: int, depth: float, trial: int) -> random.Random:
    """The random source of one cell: the same run seed and cell always draw the same choices (a string seed is
    hashed with SHA-512, independently of PYTHONHASHSEED)."""
    return random.Random(f"needle/{seed}/{length}/{float(depth)!r}/{trial}")


@dataclass(frozen=True)
class Plant:
    """One cell's needles and question: ``sentences[0]`` is the needle asked about, ``depths[i]`` where
    ``sentences[i]`` goes (percent of the haystack)."""

    sentences: tuple[str, ...]
    depths: tuple[float, ...]
    question: str
    expected: str
    follow_ups: tuple[tuple[str, str], ...] = ()  # (question, expected) of the other needles, multikey only


def make_plant(setup: NeedleSetup, depth: float, rng: random.Random) -> Plant:
    """The needles and question of ``setup.task`` for a cell at ``depth``, drawn from ``rng``."""
    if setup.task == "passkey":
        key = str(rng.randrange(10000, 100000))
        return Plant((f"The secret passkey is {key}. Remember it. {key} is the passkey.",), (depth,),
                     "What is the secret passkey mentioned in the text above?" + NUMBER_ONLY, key)
    if setup.task == "multikey":
        count = setup.key_count
        locks = rng.sample(LOCKS, count)
        keys = [str(k) for k in rng.sample(range(10000, 100000), count)]
        others = tuple(round(rng.uniform(0, 100), 1) for _ in range(count - 1))
        questions = [f"What is the passkey for the {lock} mentioned in the text above?" + NUMBER_ONLY
                     for lock in locks]
        return Plant(tuple(f"The passkey for the {lock} is {key}." for lock, key in zip(locks, keys)),
                     (depth, *others), questions[0], keys[0], tuple(zip(questions[1:], keys[1:])))
    fact = rng.choice(FACTS)
    return Plant((fact.statement,), (depth,), fact.question + ANSWER_BRIEFLY, fact.answer)


# ---------------------------------------------------------------------------------------------------- scoring
def answer_is_correct(answer: str, expected: str) -> bool:
    """Whether ``expected`` appears in ``answer`` as a whole (not inside a longer number or word), ignoring case
    and how the words of a name are spaced (``"Oswin\\nTarrow"`` answers ``"Oswin Tarrow"``)."""
    words = r"\s+".join(re.escape(word) for word in expected.split())
    return re.search(rf"(?<!\w){words}(?!\w)", answer, flags=re.IGNORECASE) is not None


# --------------------------------------------------------------------------------------------------- haystack
def token_starts(tokenizer, text: str, add_special_tokens: bool = False) -> tuple[list[int], list[int]]:
    """``(ids, starts)`` of ``text``: its token ids and the character where each token starts (special tokens
    the tokenizer adds start at 0)."""
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]]


_LINE_OR_SENTENCE = re.compile(r"\n|[.!?]\s+")
_WORD_BREAK = re.compile(r"\s+")


def boundary_near(text: str, target: int) -> int:
    """The place in ``text`` nearest ``target`` where a sentence can go in: a line start or the end of a sentence
    (or of the text), else, with none within :data:`MAX_BOUNDARY_SHIFT` characters, a word start."""

    def nearest(pattern: re.Pattern) -> int:
        places = [0, *(m.end() for m in pattern.finditer(text)), len(text)]
        i = bisect.bisect_left(places, target)
        return min(places[max(i - 1, 0) : i + 1], key=lambda place: abs(place - target))

    place = nearest(_LINE_OR_SENTENCE)
    return place if abs(place - target) <= MAX_BOUNDARY_SHIFT else nearest(_WORD_BREAK)


def plant_sentences(text: str, sentences: Sequence[str], places: Sequence[int]) -> tuple[str, int]:
    """``text`` with ``sentences[i]`` on a line of its own at character ``places[i]`` (a boundary), and where
    ``sentences[0]`` starts in the result."""
    pieces: list[str] = []
    written = cursor = asked_at = 0
    for place, index in sorted((place, index) for index, place in enumerate(places)):
        before = text[cursor:place]
        previous = before or (pieces[-1] if pieces else "")
        if previous and not previous.endswith("\n"):
            before += "\n"
        if index == 0:
            asked_at = written + len(before)
        pieces += [before, sentences[index] + "\n"]
        written += len(before) + len(sentences[index]) + 1
        cursor = place
    pieces.append(text[cursor:])
    return "".join(pieces).rstrip(), asked_at


class Haystack:
    """A long text, tokenized once, whose runs of tokens become the haystacks of the prompts."""

    def __init__(self, text: str, tokenizer, name: str = "the text") -> None:
        self.text = text
        self.name = name
        _, self.starts = token_starts(tokenizer, text)

    def __len__(self) -> int:
        return len(self.starts)

    def random_start(self, rng: random.Random, tokens: int) -> int:
        """A token index at a line start, chosen by ``rng``, with at least ``tokens`` tokens from there on (a
        :class:`ConfigError` naming ``text`` and the setup's ``lengths`` where the text is shorter)."""
        last = len(self) - tokens
        if last < 0:
            raise ConfigError("{name} has {count} tokens, too few for a prompt of {tokens}; choose a longer {text} "
                              "or shorter {lengths}.", name=self.name, count=len(self), tokens=tokens)
        pick = self.starts[rng.randint(0, last)]
        return bisect.bisect_left(self.starts, self.text.rfind("\n", 0, pick) + 1)

    def planted(self, start: int, tokens: int, plant: Plant) -> tuple[str, int]:
        """The ``tokens`` tokens from token ``start`` as text, with ``plant``'s sentences at their depths (percent
        of those tokens, moved to the nearest boundary), and where the asked sentence starts in it."""
        stop = start + tokens
        first = self.starts[start]
        end = self.starts[stop] if stop < len(self) else len(self.text)
        text = self.text[first:end].rstrip()
        places = []
        for depth in plant.depths:
            at = start + round(depth / 100 * tokens)
            target = self.starts[at] - first if at < stop else len(text)
            places.append(boundary_near(text, min(target, len(text))))
        return plant_sentences(text, plant.sentences, places)


# ----------------------------------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class NeedlePrompt:
    """One cell's prompt, ready to run, and where its needle and haystack sit in it (token indices)."""

    length: int  # the requested length; ``len(ids)`` is at most this and a few tokens short at worst
    depth: float  # the requested depth, percent of the haystack
    trial: int
    ids: tuple[int, ...]
    question: str
    expected: str
    needle: tuple[int, int]  # [start, stop) tokens of the asked needle sentence
    document: tuple[int, int]  # [start, stop) tokens of the haystack with every needle in it
    message: str = ""  # the prompt's text: its user message where the prompt is in the chat template
    follow_ups: tuple[tuple[str, str], ...] = ()  # later turns' (question, expected), with ``turns``

    def questions(self) -> list[tuple[str, str]]:
        """``(question, expected)`` of every turn: the prompt's own, then the follow-ups."""
        return [(self.question, self.expected), *self.follow_ups]

    @property
    def measured_depth(self) -> float:
        """Where the needle landed: percent of the document's other tokens that come before it."""
        others = (self.document[1] - self.document[0]) - (self.needle[1] - self.needle[0])
        return 100.0 * (self.needle[0] - self.document[0]) / max(others, 1)


def _span(starts: Sequence[int], first_char: int, stop_char: int) -> tuple[int, int]:
    """The tokens that cover characters ``[first_char, stop_char)``: the one holding the first, to the first token
    starting at or after the stop."""
    return bisect.bisect_right(starts, first_char) - 1, bisect.bisect_left(starts, stop_char)


@dataclass(frozen=True)
class _Rendered:
    ids: list[int]
    starts: list[int]
    document_at: int  # character where the document starts in the prompt text


def prompt_message(document: str, question: str) -> str:
    """The prompt's text: intro, document, question."""
    return f"{INTRO}\n\n{document}\n\n{question}"


def render_prompt(tokenizer, document: str, question: str, chat: bool) -> _Rendered:
    """Tokenize the prompt around ``document``: intro, document, question, in the chat template or plain."""
    content = prompt_message(document, question)
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        ids, starts = token_starts(tokenizer, text)  # as apply_chat_template(tokenize=True) tokenizes it
    else:
        text = content + PLAIN_ANSWER_CUE
        ids, starts = token_starts(tokenizer, text, add_special_tokens=True)
    at = text.find(content)
    if at < 0:
        raise UserError("The model's chat template rewrites the message text, so the needle cannot be located; "
                        "run it without the chat template.")
    return _Rendered(ids, starts, at + len(INTRO) + 2)


def build_prompt(tokenizer, haystack: Haystack, setup: NeedleSetup, length: int, depth: float,
                 trial: int) -> NeedlePrompt:
    """The prompt of one cell: ``length`` tokens (or a few short) with the needle at ``depth`` percent.

    Raises :class:`ConfigError` when the needles, question and template leave no room for a haystack of
    :data:`MIN_HAYSTACK_TOKENS`, or when the text is shorter than ``length`` tokens.
    """
    rng = cell_rng(setup.seed, length, depth, trial)
    plant = make_plant(setup, depth, rng)
    overhead = len(render_prompt(tokenizer, "\n".join(plant.sentences), plant.question, setup.chat).ids)
    if length < overhead + MIN_HAYSTACK_TOKENS:
        raise ConfigError("{lengths} {length} is too short: the {task_name} prompt without its haystack already "
                          "takes {overhead} tokens; give at least {least}.", length=length, task_name=setup.task,
                          overhead=overhead, least=overhead + MIN_HAYSTACK_TOKENS)
    start = haystack.random_start(rng, length)
    available = len(haystack) - start
    tokens = length - overhead
    tried = []
    for _ in range(FIT_ROUNDS):
        document, asked_at = haystack.planted(start, tokens, plant)
        rendered = render_prompt(tokenizer, document, plant.question, setup.chat)
        tried.append((rendered, document, asked_at))
        if len(rendered.ids) == length:
            break
        tokens = min(max(tokens + length - len(rendered.ids), 1), available)
    rendered, document, asked_at = min(tried, key=lambda t: (len(t[0].ids) > length, abs(length - len(t[0].ids))))
    needle_at = rendered.document_at + asked_at
    return NeedlePrompt(
        length=length, depth=depth, trial=trial, ids=tuple(rendered.ids), question=plant.question,
        expected=plant.expected,
        needle=_span(rendered.starts, needle_at, needle_at + len(plant.sentences[0])),
        document=_span(rendered.starts, rendered.document_at, rendered.document_at + len(document)),
        message=prompt_message(document, plant.question), follow_ups=plant.follow_ups if setup.turns else (),
    )


def build_prompts(tokenizer, haystack: Haystack, setup: NeedleSetup) -> list[NeedlePrompt]:
    """The prompts of every cell of ``setup``, in :meth:`NeedleSetup.cells` order."""
    return [build_prompt(tokenizer, haystack, setup, *cell) for cell in setup.cells()]


# ----------------------------------------------------------------------------------------------------- running
@dataclass
class Answer:
    """A model's answer to one prompt and what its run measured (a fake answerer may leave ``stats`` empty)."""

    text: str
    stats: RunStats = dataclasses.field(default_factory=RunStats)


def engine_answerer(target, cache, draft=None, max_new_tokens: int = 16) -> Callable[[NeedlePrompt], Answer]:
    """``answer(prompt)`` by greedy decoding through :func:`~sparsespec.engine.run_generation`: ``target`` (a
    ``LoadedModel``) with ``cache`` (``CacheOptions``) and ``draft`` (``DraftOptions`` or None), fresh arenas for
    every prompt, at most ``max_new_tokens`` new tokens, stopping at the tokenizer's end-of-sequence tokens."""
    from ..engine import run_generation
    from ..generate import stream_text
    from ..loading.tokenizer import eos_token_ids
    from ..sampling import SamplingParams

    greedy = SamplingParams(0.0, 0, 1.0)
    eos = eos_token_ids(target.tokenizer)

    def answer(prompt: NeedlePrompt) -> Answer:
        stats = RunStats()
        tokens = run_generation(target, list(prompt.ids), max_new_tokens=max_new_tokens, sampling=greedy,
                                cache=cache, eos_ids=eos, draft=draft, stats=stats)
        with closing(tokens):  # the run fills in its cache statistics when it ends, also when stopped at EOS
            text = "".join(stream_text(tokens, target.tokenizer, eos_ids=eos))
        return Answer(text.strip(), stats)

    return answer


def turns_answerer(target, cache, draft=None, max_new_tokens: int = 16) -> Callable[[NeedlePrompt], list[Answer]]:
    """``answer(prompt)`` for ``turns``: an :class:`Answer` per question of the prompt (:meth:`NeedlePrompt.questions`),
    asked in turns of one conversation, greedily, through a fresh :class:`~sparsespec.engine.Session` per prompt
    (bounded by the model's context, as ``chat`` and ``serve`` hold one): the first turn is the prompt, each later
    one the conversation so far (the answers as the model gave them) with the next question as a new user message,
    read from where the session's arenas stopped."""
    from ..engine import Session
    from ..generate import stream_text
    from ..loading.tokenizer import eos_token_ids
    from ..sampling import SamplingParams

    greedy = SamplingParams(0.0, 0, 1.0)
    tokenizer = target.tokenizer
    eos = eos_token_ids(tokenizer)

    def answer(prompt: NeedlePrompt) -> list[Answer]:
        session = Session(target, cache, draft, capacity=target.config.max_position_embeddings)
        messages, answers = [], []
        for turn, (question, _) in enumerate(prompt.questions()):
            messages.append({"role": "user", "content": prompt.message if turn == 0 else question})
            ids = list(prompt.ids) if turn == 0 else tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True)
            stats = RunStats()
            tokens = session.run(ids, max_new_tokens=max_new_tokens, sampling=greedy, seed=0, eos_ids=eos,
                                 stats=stats)
            with closing(tokens):
                text = "".join(stream_text(tokens, tokenizer, eos_ids=eos))
            messages.append({"role": "assistant", "content": text})
            answers.append(Answer(text.strip(), stats))
        return answers

    return answer


def plain_value(value):
    """``value`` as JSON can hold it: plain values as they are, a policy (anything with ``describe()``) by its
    description, anything else as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    describe = getattr(value, "describe", None)
    return describe() if callable(describe) else str(value)


def cache_fields(cache) -> dict:
    """A ``CacheOptions`` for a record: policy, positions, KV dtype and retention on their own, and every field
    of the options under ``cache`` (so fields added later are recorded as well)."""
    return {
        "policy": cache.policy.name, "budget": cache.policy.budget, "positions": cache.positions,
        "kv_dtype": cache.kv_dtype, "retention": plain_value(getattr(cache, "retention", None)),
        "cache": {f.name: plain_value(getattr(cache, f.name)) for f in dataclasses.fields(cache)},
    }


def cache_label(cache) -> str:
    """One line naming a ``CacheOptions``: ``hybrid(sinks=4, heavy=126, window=126), in-cache, KV int8``."""
    parts = [cache.policy.describe()]
    if not cache.policy.is_full:
        parts.append(cache.positions)
    if cache.kv_dtype != "auto":
        parts.append(f"KV {cache.kv_dtype}")
    retention = getattr(cache, "retention", None)
    if retention is not None and not cache.policy.is_full:
        parts.append(f"retention {plain_value(retention)}")
    if getattr(cache, "recall_pages", None) is not None:
        parts.append(f"recall {cache.recall_pages} pages")
    return ", ".join(parts)


def needle_record(prompt: NeedlePrompt, answer: Answer, setup: NeedleSetup, context: Mapping,
                  turn: int = 0) -> dict:
    """One cell's JSON record (one per turn with ``turns``: ``turn`` counts from 0, the prompt's own question): the
    cell, the question and answer, ``correct``, ``context`` (model, cache, draft: what the run holds fixed), and the
    run's statistics (with the arena's own budget when the run reports one; a later turn's ``reused_tokens`` are
    the conversation the session resumed from)."""
    question, expected = prompt.questions()[turn]
    record = {
        "task": setup.task, "length": prompt.length, "prompt_tokens": len(prompt.ids), "depth": prompt.depth,
        "measured_depth": round(prompt.measured_depth, 2), "needle_token": prompt.needle[0], "trial": prompt.trial,
        "seed": setup.seed, "keys": setup.key_count, "chat": setup.chat, "turns": setup.turns, "turn": turn,
        "question": question, "expected": expected, "answer": answer.text,
        "correct": answer_is_correct(answer.text, expected),
        **context,
    }
    stats = answer.stats.to_dict()
    if turn == 0:
        del stats["prompt_tokens"]  # the prompt's own count stands (a fake answerer's empty stats say 0)
    else:
        stats["turn_prompt_tokens"] = stats.pop("prompt_tokens")  # the conversation so far, this turn's question in
    if setup.turns:
        stats["reused_tokens"] = answer.stats.reused_tokens
    record.update(stats)
    if answer.stats.budget is not None:
        record["budget"] = answer.stats.budget
    return record


def run_needle_grid(prompts: Sequence[NeedlePrompt], answer: Callable[[NeedlePrompt], Answer], setup: NeedleSetup,
                    context: Mapping, *, on_record: Callable[[dict], None] | None = None,
                    progress: bool = True) -> list[dict]:
    """Ask ``answer`` every prompt in turn; return the records (:func:`needle_record`: one per answer, where
    ``answer`` gives a list of them, one per turn), each also handed to ``on_record`` as soon as it is made.
    ``progress`` shows a bar over the cells on stderr."""
    from tqdm import tqdm

    records: list[dict] = []
    with tqdm(total=len(prompts), unit="cell", desc=f"needle {setup.task}", file=sys.stderr, leave=False,
              disable=not progress) as bar:
        for prompt in prompts:
            bar.set_postfix_str(f"{prompt.length} tokens, depth {prompt.depth:g}%")
            answers = answer(prompt)
            for turn, reply in enumerate(answers if isinstance(answers, list) else [answers]):
                record = needle_record(prompt, reply, setup, context, turn)
                records.append(record)
                if on_record is not None:
                    on_record(record)
            bar.update()
    return records


# ----------------------------------------------------------------------------------------------------- summary
@dataclass(frozen=True)
class ScoreGrid:
    """Correct answers per (length, depth) cell of a set of records."""

    lengths: list[int]
    depths: list[float]
    cells: dict[tuple[int, float], tuple[int, int]]  # (length, depth) -> (correct, trials)

    @property
    def correct(self) -> int:
        return sum(c for c, _ in self.cells.values())

    @property
    def total(self) -> int:
        return sum(t for _, t in self.cells.values())

    @property
    def fraction(self) -> float:
        return self.correct / self.total if self.total else 0.0


def score_grid(records: Iterable[Mapping]) -> ScoreGrid:
    """Tally ``correct`` over the records by (requested length, depth)."""
    cells: dict[tuple[int, float], tuple[int, int]] = {}
    for r in records:
        key = (r["length"], float(r["depth"]))
        correct, total = cells.get(key, (0, 0))
        cells[key] = (correct + bool(r["correct"]), total + 1)
    return ScoreGrid(sorted({k[0] for k in cells}), sorted({k[1] for k in cells}), cells)


def score_turns(records: Iterable[Mapping]) -> dict[int, tuple[int, int]]:
    """``{turn: (correct, total)}`` of the records, turns counted from 0 (a run without turns has turn 0 only)."""
    turns: dict[int, tuple[int, int]] = {}
    for r in records:
        correct, total = turns.get(r.get("turn", 0), (0, 0))
        turns[r.get("turn", 0)] = (correct + bool(r["correct"]), total + 1)
    return dict(sorted(turns.items()))


def summary_table(records: Iterable[Mapping]) -> str:
    """A text table, one row per length and one column per depth, of correct answers out of trials (and turns),
    the overall score, and with ``turns`` each turn's."""
    records = list(records)
    grid = score_grid(records)
    width = max([7, *(len(f"{t}/{t}") + 2 for _, t in grid.cells.values())])
    lines = ["length \\ depth" + "".join(f"{d:g}%".rjust(width) for d in grid.depths)]
    for length in grid.lengths:
        row = [grid.cells.get((length, d)) for d in grid.depths]
        lines.append(f"{length:>14}" + "".join(("-" if c is None else f"{c[0]}/{c[1]}").rjust(width) for c in row))
    lines.append(f"overall  {grid.correct}/{grid.total} correct ({grid.fraction:.0%})")
    turns = score_turns(records)
    if len(turns) > 1:
        lines.append("by turn  " + ", ".join(f"{turn + 1}: {c}/{t}" for turn, (c, t) in turns.items()))
    return "\n".join(lines)


def plot_heatmap(records: Sequence[Mapping], path: str | Path, heading: str) -> Path:
    """Write the familiar heatmap as a PNG: depth (%) across, context length (tokens) up, each cell coloured by
    its fraction of correct answers (red 0 … green 1) and annotated with correct/trials; ``heading`` (model and
    cache), the task and the overall score as the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = score_grid(records)
    fractions = np.full((len(grid.lengths), len(grid.depths)), np.nan)
    path = Path(path)
    fig, ax = plt.subplots(figsize=(1.2 * len(grid.depths) + 3, 0.6 * len(grid.lengths) + 2.2))
    for row, length in enumerate(grid.lengths):
        for col, depth in enumerate(grid.depths):
            if (length, depth) in grid.cells:
                correct, total = grid.cells[(length, depth)]
                fractions[row, col] = correct / total
                ink = "black" if 0.25 < correct / total < 0.75 else "white"  # readable on the dark ends
                ax.text(col, row, f"{correct}/{total}", ha="center", va="center", fontsize=9, color=ink)
    image = ax.imshow(fractions, cmap="RdYlGn", vmin=0.0, vmax=1.0, origin="lower", aspect="auto")
    fig.colorbar(image, ax=ax, label="fraction correct")
    ax.set_xticks(range(len(grid.depths)), [f"{d:g}" for d in grid.depths])
    ax.set_yticks(range(len(grid.lengths)), [str(n) for n in grid.lengths])
    ax.set_xticks(np.arange(len(grid.depths) + 1) - 0.5, minor=True)  # white lines between the cells
    ax.set_yticks(np.arange(len(grid.lengths) + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("needle depth (% of the haystack)")
    ax.set_ylabel("context length (tokens)")
    tasks = ", ".join(sorted({r["task"] for r in records}))
    ax.set_title(f"{heading}\n{tasks}: {grid.correct}/{grid.total} correct ({grid.fraction:.0%})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
