"""The one exception type that carries a user-facing message.

Anything raised as :class:`UserError` is a mistake in what the user asked for (a bad flag, a missing file, a
prompt that does not fit). The CLI prints its message as one sentence and exits non-zero; everything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, explained in one sentence."""
