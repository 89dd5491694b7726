"""Decoding as programs that ask for forward passes, so that one driver can run many of them in shared passes.

A *decoding program* is a generator. It yields a :class:`Pass` when it needs logits, and the driver sends the
pass's logits back; it yields an ``int`` for every new token, and the driver sends nothing back. The decoding loops
(``generate.py``, ``speculative.py``, ``engine.Session``) are written once, as programs:

- :func:`run_alone` runs one program pass by pass and yields its tokens (the CLI, the benchmarks, one request);
- :class:`Batch` runs several programs together: each step gathers the passes they wait for and runs them as one
  pass per model (``Transformer.forward_blocks``: the weights stream once for the rows of all of them), so the
  server decodes for several users at about the cost of one.

A program may be closed (``.close()``) where it yields a token: its arenas are then committed and consistent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Iterator, Sequence

import torch

from .cache.arena import KVArena
from .model import Block, Transformer


@dataclass(frozen=True)
class Pass:
    """A forward pass a program asks for: ``model`` over one block of rows. ``draft``: a draft model's pass (a
    :class:`Batch` runs those first, so that speculative rounds of several programs reach verification together)."""

    model: Transformer
    block: Block
    draft: bool = False

    @property
    def rows(self) -> int:
        return self.block.tokens.shape[0]


Program = Generator["Pass | int", "torch.Tensor | None", None]


def forward_pass(
    model: Transformer, tokens: list[int], cache: KVArena, *, per_block: bool = False, last_only: bool = False,
    draft: bool = False, parents: list[int] | None = None,
) -> Pass:
    """The :class:`Pass` of ``tokens`` through ``model`` over ``cache`` (see ``Transformer.forward``; ``parents``:
    the rows as a tree)."""
    return Pass(model, Block(torch.tensor(tokens, dtype=torch.long), cache, per_block, last_only, parents), draft)


def run_passes(passes: Sequence[Pass]) -> list[torch.Tensor]:
    """Run ``passes`` (at most one per arena) as one forward pass per model; their logits, in order."""
    logits: list[torch.Tensor | None] = [None] * len(passes)
    by_model: dict[int, list[int]] = {}
    for i, p in enumerate(passes):
        by_model.setdefault(id(p.model), []).append(i)
    for indices in by_model.values():
        model = passes[indices[0]].model
        for i, out in zip(indices, model.forward_blocks([passes[i].block for i in indices])):
            logits[i] = out
    return logits


def run_alone(program: Program) -> Iterator[int]:
    """Run ``program`` by itself, one pass at a time; yield its tokens. Closing this closes the program."""
    reply = None
    try:
        while True:
            try:
                item = program.send(reply)
            except StopIteration:
                return
            if isinstance(item, Pass):
                reply = run_passes([item])[0]
            else:
                reply = None
                yield item
    finally:
        program.close()


def run_to_end(program: Program) -> None:
    """Run a program that yields no tokens (a prefill) to its end."""
    for _ in run_alone(program):
        raise RuntimeError("a prefill program yielded a token")


class Running:
    """One program in a :class:`Batch`: the pass it waits for, where its tokens go and who hears of its end.

    ``on_token(token)`` returns False to stop the program at that token (it is closed there); ``on_end(error)`` is
    called once when the program has ended: ``None`` after its last token or a stop, else the exception it raised.
    """

    def __init__(self, program: Program, on_token: Callable[[int], bool],
                 on_end: Callable[[BaseException | None], None]):
        self.program = program
        self.on_token = on_token
        self.on_end = on_end
        self.waiting: Pass | None = None
        self._resume(lambda: program.send(None))

    @property
    def finished(self) -> bool:
        return self.waiting is None

    def _resume(self, advance: Callable[[], "Pass | int"]) -> None:
        """Run the program (``advance`` takes its first step) until it waits for a pass or ends."""
        self.waiting = None
        try:
            item = advance()
            while not isinstance(item, Pass):
                if not self.on_token(item):
                    self.program.close()
                    self.on_end(None)
                    return
                item = self.program.send(None)
        except StopIteration:
            self.on_end(None)
            return
        except Exception as exc:
            self.on_end(exc)
            return
        self.waiting = item

    def resume_with(self, logits: torch.Tensor) -> None:
        """Resume the program with the logits of the pass it waited for."""
        self._resume(lambda: self.program.send(logits))

    def fail(self, error: Exception) -> None:
        """The pass this program waited for raised ``error``: raise it inside the program (which discards what its
        arenas hold), then end it."""
        self._resume(lambda: self.program.throw(error))
        if not self.finished:  # it went on regardless: stop it
            self.close()

    def close(self) -> None:
        """End the program where it is (its arenas are consistent only if it stopped at a token)."""
        if not self.finished:
            self.waiting = None
            self.program.close()
            self.on_end(None)


class Batch:
    """Programs decoded together, one shared pass per step."""

    def __init__(self) -> None:
        self.running: list[Running] = []

    def add(self, program: Program, on_token: Callable[[int], bool],
            on_end: Callable[[BaseException | None], None]) -> Running:
        """Start ``program`` (it runs up to its first pass now); see :class:`Running` for the callbacks."""
        running = Running(program, on_token, on_end)
        if not running.finished:
            self.running.append(running)
        return running

    def step(self) -> int:
        """Run one pass: for the programs waiting on a draft's pass if any do, else for all; resume them with their
        logits. Returns the rows the pass ran (0 when no program waits).

        If the pass itself raises, every program in it ends with that error (see :meth:`Running.fail`).
        """
        waiting = [r for r in self.running if not r.finished]
        group = [r for r in waiting if r.waiting.draft] or waiting
        rows = sum(r.waiting.rows for r in group)
        if group:
            try:
                logits = run_passes([r.waiting for r in group])
            except Exception as exc:
                for running in group:
                    running.fail(exc)
            else:
                for running, out in zip(group, logits):
                    running.resume_with(out)
        self.running = [r for r in self.running if not r.finished]
        return rows
