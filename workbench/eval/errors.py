"""The one error type of `workbench.eval`: input the user can fix, said in one line."""

from __future__ import annotations


class EvalError(ValueError):
    """A model, task, data file or option that cannot be evaluated; the message names it.

    The CLI prints it as one `error: ...` line and exits with code 2."""

    def one_line(self, limit: int = 400) -> str:
        # Paths and task names come from the user: escape control characters, keep one line.
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(self))
        return text if len(text) <= limit else text[: limit - 3] + "..."
