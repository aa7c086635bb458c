"""The one exception type that means "the user's input is wrong" (exit code 2)."""


class BadInput(Exception):
    """Raised with a one-line message that names the field or file and says what to do."""
