"""The exceptions that carry a user-facing message, and how a front end words them.

Anything raised as :class:`UserError` is a mistake in what the user asked for (a bad setting, a missing file, a
prompt that does not fit). The CLI prints its message as one sentence and exits non-zero; the server answers it
with a 400; everything else is a bug and keeps its traceback.

The library speaks in its own terms: a mistake in a setting is a :class:`ConfigError`, whose message names the
parameters as the Python API spells them (``gamma must be at least 1 (got 0).``). A front end rewords it in the
names its user typed — the CLI's flags (``--gamma``), the server's request fields (``max_tokens``) — with
:func:`user_message` and its own table of names; only the library's parameter names are rewritten, never the
values quoted in the message.
"""

from __future__ import annotations

import string
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class UserError(Exception):
    """A problem with the user's input, explained in one sentence."""


class ConfigError(UserError):
    """A setting out of range, or settings that do nothing together, named by their parameter names.

    ``template`` is the sentence with each parameter written as a field (``"{gamma} must be at least 1 (got
    {value})."``); ``values`` fill the other fields (quoted values, sizes, names), so that a value holding braces
    stays text. :attr:`params` are the template's fields that ``values`` does not fill, in the order they appear:
    the parameters the mistake is about. ``str(error)`` writes each parameter as its own name.
    """

    def __init__(self, template: str, **values: object) -> None:
        self.template = template
        self.values = values
        fields = (name for _, name, _, _ in string.Formatter().parse(template) if name)
        self.params: tuple[str, ...] = tuple(dict.fromkeys(name for name in fields if name not in values))
        super().__init__(self.render())

    def render(self, names: Mapping[str, str] | None = None) -> str:
        """The message with each parameter written as ``names`` calls it (its own name where ``names`` has none)."""
        names = names or {}
        return self.template.format(**{param: names.get(param, param) for param in self.params}, **self.values)

    def after(self, template: str, **values: object) -> ConfigError:
        """This error's sentence after the clause ``template`` (with its own ``values``: a name both fill is a
        TypeError), as where a setting led to the mistake: ``"{kv_bytes} ... leaving a budget of 0: "``."""
        return ConfigError(template + self.template, **values, **self.values)


def user_message(error: BaseException, names: Mapping[str, str]) -> str:
    """``error``'s sentence for a front end whose user named the library's parameters as ``names`` says
    (parameter → flag or field); any other error's as it is."""
    return error.render(names) if isinstance(error, ConfigError) else str(error)


@contextmanager
def reworded(names: Mapping[str, str]) -> Iterator[None]:
    """A :class:`ConfigError` raised inside leaves as a :class:`UserError` worded with ``names``: for a front end
    that knows which of its flags or fields fed the settings read inside (the draft's copies of the cache flags)."""
    try:
        yield
    except ConfigError as exc:
        raise UserError(exc.render(names)) from None
