"""The refusals a command answers with one line: errors a user can fix, not bugs.

Raise ``UsageError`` for what the command line asked (a value out of range, a path or dataset
that does not exist: exit status 2, as argparse gives) and ``CommandError`` for work that cannot go
on (a server that refused, a full cache: status 1). ``shards.commands.main`` prints the message
as ``PROG COMMAND: error: MESSAGE`` on stderr and exits with the status; anything else is a bug
and keeps its traceback.
"""


class CommandError(Exception):
    """The work cannot go on for a reason the message gives; the message is the whole line."""
    status = 1


class UsageError(CommandError):
    """The command line asks for something that cannot be done."""
    status = 2


class NotFound(UsageError, FileNotFoundError):
    """A path, URL or dataset named on the command line does not exist (still a FileNotFoundError
    for code that catches those)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
