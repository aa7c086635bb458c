"""The exceptions every stage answers with its own exit code: bad input (2) and a stop by SIGTERM (130)."""


class BadInput(Exception):
    """Raised with a one-line message that names the field or file and says what to do."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (`scripts/remote.sh stop`, a scheduler, a shutdown): handled like Ctrl-C."""
