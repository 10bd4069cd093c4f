"""The one base class for errors a user can cause or fix.

Its message is one sentence saying what is wrong and what to do; the command line prints it and exits 2,
the pages show it, the worker sends it back as a refusal."""


USER_ERROR = 2  # the exit code of every refusal on the command line


class UserError(Exception):
    """Input or a state the user can fix; str(exc) is one sentence for them."""


def first_line(exc: BaseException, limit: int = 160) -> str:
    """An exception's first line of text (its type's name where it has none), cut to `limit` characters: what a
    one-sentence message quotes of a library's error."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__
