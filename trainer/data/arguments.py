"""The reading API's arguments, checked when a loader is made, and its warnings, pointed at the caller.

A loader's or dataset's table maps each argument to its rule (``Number``, ``OneOf``, ``Flag``, ``Size``,
``Function``); ``check`` applies it before any shard is read. A wrong value is one ``ValueError`` naming
the argument and what it may be (``batch_size: 0 is out of range: give 1 or more``, in the words
``trainer.config`` uses for the flags: ``--batch-size: 0 is out of range: give 1 or more``), a value of
the wrong type a ``TypeError`` (``batch_size must be an int, not float 4.0``), never a
``ZeroDivisionError`` in the partition or a failure inside PIL in a loader worker.

``warn``: a warning at the line of the code that called the library, the first frame outside this
package and torch's (whose ``DataLoader`` runs a dataset's ``__iter__``): what Python 3.12's
``skip_file_prefixes`` does, for 3.11.

For the trainer: ``loader_kwargs(cfg)``, the loader options a config (``trainer.config.Data``,
``Evaluation``) holds, by the loader's names, the planner's apart (``PLANNER_FROM_CONFIG`` and
``LOADER_FROM_CONFIG``: one line per option, the only copy), and
``worded_as_flags(cfg)``, the library's ``ValueError`` and ``TypeError`` refused as a ``UsageError`` in
the words of that config's flags (``batch_size: ...`` -> ``--batch-size: ...``).
"""
from __future__ import annotations

import dataclasses
import numbers
import os
import re
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec

import torch

from shards.base.commands import number_in_range
from shards.base.errors import CommandError, UsageError
from shards.base.units import parse_size

KINDS = {int: (numbers.Integral, "an int"), float: (numbers.Real, "a number")}


def wrong_type(name: str, value, wanted: str) -> TypeError:
    return TypeError(f"{name} must be {wanted}, not {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class Number:
    """An int (or with ``kind=float``, any real number) in [low, high]; no bound where None. ``none``:
    None is allowed too (a default the loader fills in)."""
    low: float | None = 0
    high: float | None = None
    kind: type = int
    none: bool = False

    def __call__(self, name: str, value) -> None:
        if value is None and self.none:
            return
        cls, words = KINDS[self.kind]
        if isinstance(value, bool) or not isinstance(value, cls):
            raise wrong_type(name, value, words + (" or None" if self.none else ""))
        if self.low is not None:
            try:
                number_in_range(self.kind, self.low, self.high).in_range(value)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None


@dataclass(frozen=True)
class OneOf:
    """One of ``choices``."""
    choices: tuple

    def __call__(self, name: str, value) -> None:
        if value not in self.choices:
            raise ValueError(f"{name}={value!r}: give one of {', '.join(map(repr, self.choices))}")


@dataclass(frozen=True)
class Flag:
    """True or False (or None, where ``none``: the loader decides)."""
    none: bool = False

    def __call__(self, name: str, value) -> None:
        if not isinstance(value, bool) and not (value is None and self.none):
            raise wrong_type(name, value, "True, False or None" if self.none else "True or False")


@dataclass(frozen=True)
class Size:
    """Bytes: an int of 1 or more, a size in words (``"2GB"``), or None."""

    def __call__(self, name: str, value) -> None:
        if isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError:
                raise ValueError(f"{name}={value!r}: not a size (e.g. 2GB, 500MB, 4096)") from None
        Number(1, none=True)(name, value)


@dataclass(frozen=True)
class Function:
    """A callable, or None."""

    def __call__(self, name: str, value) -> None:
        if value is not None and not callable(value):
            raise wrong_type(name, value, "a callable or None")


def check(rules: dict, values: dict) -> None:
    """Every argument in ``rules`` by its rule (``values``: the arguments given, by name)."""
    for name, rule in rules.items():
        rule(name, values[name])


def _inside() -> tuple[str, ...]:
    """The directories whose frames are the library's, not the caller's: this package, torch and
    torchdata (a ``StatefulDataLoader`` runs a dataset's ``__iter__`` through torch's worker loop)."""
    spec = find_spec("torchdata")
    places = [os.path.dirname(__file__), os.path.dirname(torch.__file__),
              *(spec.submodule_search_locations if spec and spec.submodule_search_locations else ())]
    return tuple(os.path.join(p, "") for p in places)


INSIDE = _inside()


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` at the caller's line: the first frame outside ``INSIDE`` (in a loader worker,
    where no frame is the caller's, the outermost one)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


# a trainer config's fields that are loader options, by the option's name: the planner's
# (``trainer.data.epochs.EpochOptions``) and ``ClipLoader``'s own
PLANNER_FROM_CONFIG = {"batch_size": "batch_size", "shuffle_buffer": "shuffle_buffer",
                       "stored_clips": "stored_clips"}
LOADER_FROM_CONFIG = {"workers": "num_workers", "crop_size": "crop_size", "scale_size": "scale_size",
                      "flip": "flip", "cache_dir": "cache_dir", "lookahead": "lookahead",
                      "decode_on_device": "decode_on_device", "modality": "modality",
                      "source_deadline": "source_deadline", "crops": "eval_crops"}
FROM_CONFIG = PLANNER_FROM_CONFIG | LOADER_FROM_CONFIG


def loader_kwargs(cfg) -> tuple[dict, dict]:
    """The loader options the config dataclass ``cfg`` holds, by the options' names: the planner's (for
    an ``EpochOptions``, with what the config does not hold: the placement, the seed, ...) and the
    loader's own (``ClipLoader``'s keywords)."""
    def held(table: dict) -> dict:
        return {option: getattr(cfg, field) for field, option in table.items() if hasattr(cfg, field)}
    return held(PLANNER_FROM_CONFIG), held(LOADER_FROM_CONFIG)


def flag_words(message: str, cfg) -> str:
    """``message`` with the loader options it names (``crop_size``; an option without an underscore only
    as ``flip=`` or ``flip:``) spelled as ``cfg``'s flags (``--crop-size``)."""
    for f in dataclasses.fields(cfg):
        option = FROM_CONFIG.get(f.name)
        if option:
            flag = f.metadata.get("spelling") or "--" + f.name.replace("_", "-")
            message = re.sub(rf"\b{option}\b" + ("" if "_" in option else "(?=[=:])"), flag, message)
    return message


@contextmanager
def worded_as_flags(cfg):
    """The library's ``ValueError`` or ``TypeError`` raised inside, as a ``UsageError`` in the words of
    ``cfg``'s flags (``flag_words``); the project's own refusals (``CommandError``) as they are."""
    try:
        yield
    except CommandError:
        raise
    except (ValueError, TypeError) as error:
        raise UsageError(flag_words(str(error), cfg)) from error
