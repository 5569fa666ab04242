"""The trainer's typed refusals: flags that cannot go together, or a run they cannot continue.

Raised anywhere in the trainer (``Regime``, ``KStepBackend``, ``Trainer``, the configs). They are
the project's refusals (``shards.base.errors``): the command-line entry (``trainer.cli``) prints the
message as every command does, ``trainer COMMAND: error: MESSAGE`` on one line, and exits with
the status (1: ``ConfigError``; 2: ``OutOfRange``, as argparse's refusal of the same value).
Code that uses the classes from Python catches them by class.
"""
from shards.base.errors import CommandError, UsageError


class ConfigError(CommandError):
    """Flags that cannot go together, or a checkpoint the run cannot continue; the message is the
    whole line users read (after ``trainer COMMAND: error:``)."""


class OutOfRange(UsageError, ValueError):
    """A config field outside its flag's range, set from Python (``Data(batch_size=0)``): the line
    names the flag and the range, as the flag's own refusal does."""
