"""User-facing errors.

Every problem a user can cause (a wrong path, a mismatched drafter, a bad
override) is raised as a :class:`DFlash2Error` whose message is one line that
names the thing and the fix. Entry points print that line instead of a
traceback.
"""


class DFlash2Error(Exception):
    """A user-correctable problem; the message says what and how to fix it."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line
