"""The refusals a command answers with one line: errors a user can fix, not bugs.

Raise ``UsageError`` for what the command line asked (a value out of range, a path or dataset
that does not exist: exit status 2, as argparse gives) and ``CommandError`` for work that cannot go
on (a server that refused, a full cache: status 1). ``shards.base.commands.main`` prints the message
as ``PROG COMMAND: error: MESSAGE`` on stderr and exits with the status; anything else is a bug
and keeps its traceback.

``NoSpace`` is a write that found its filesystem full (``shards.io.storage.room_for`` makes one
from the ``OSError``), naming the path and the bytes needed and free. ``Interrupted`` is Ctrl-C
(status 130, as a shell reports a process SIGINT ended), with what is kept and how to go on.

``DataFault`` is the refusal of the data path itself, raised while a run reads (a sample whose
bytes differ from the manifest, a source that stayed unreachable past its deadline): a training
run stops on one as it stops on a signal, with its position saved, so ``--resume`` continues from
the batch it stopped at. ``resume`` says whether resuming as is can succeed (a source that comes
back) or needs something done first (a damaged sample repaired or skipped).
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


class NoSpace(CommandError, OSError):
    """A write found no room (ENOSPC, a quota's EDQUOT, a file-size limit's EFBIG); the message names
    the path, the bytes the write needed and the bytes free. Still an OSError for code that catches those."""


class Interrupted(CommandError):
    """Ctrl-C stopped the work; the message says what is kept and how to continue."""
    status = 130  # 128 + SIGINT


class DataFault(CommandError):
    """The data a run reads failed it; the message names the shard, sample or URL and the reason.

    ``facts``: what a caller may act on (a skipped sample's shard, key and digests), kept as
    attributes. The message stays the one raised, and the fault pickles as it was raised (a loader
    worker sends it to its rank), whatever a reader it passes through appends to its ``args``
    (webdataset's tar stages append the stream and URL: a stream cannot be pickled)."""
    resume = False  # whether `--resume` as is can go on (a transient cause), or needs a fix first

    def __init__(self, message: str, **facts):
        super().__init__(message)
        self.message = message
        self.__dict__.update(facts)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return type(self), (self.message,), self.__dict__


class SourceUnavailable(DataFault):
    """A source that refused connections, timed out or answered 502/503/504 until its deadline."""
    status = 75  # EX_TEMPFAIL: try again later (Slurm's --requeue and job arrays read it so)
    resume = True
