"""The trainer's typed refusals: flags that cannot go together, or a run they cannot continue.

Raised anywhere in the trainer (``Regime``, ``KStepBackend``, ``Trainer``); the command-line entry
(``trainer.cli``) prints the message, one line naming the flags and the reason, and exits with
status 1, as a ``SystemExit`` with that message did before. Code that uses the classes from Python
catches ``ConfigError`` instead of ``SystemExit``.
"""


class ConfigError(Exception):
    """Flags that cannot go together, or a checkpoint the run cannot continue; the message is the
    whole line users read."""
