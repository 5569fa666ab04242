"""trainer.config: a config built in Python refuses what its flags refuse on the command line, in
the same words (one line naming the flag and the range), instead of failing later (a batch of 0
clips ended in ZeroDivisionError)."""
from __future__ import annotations

import dataclasses

import pytest

from shards.base.errors import UsageError
from trainer import config
from trainer.errors import OutOfRange

REQUIRED = {config.Data: {"data": "set"}, config.Evaluation: {"data": ("set",)}}
PARSERS = {config.Elastic: config.add_elastic_arguments, config.Evaluation: config.add_evaluation_arguments}
CHECKED = [(cls, f) for cls in (*config.CONCERNS.values(), config.Elastic, config.Evaluation)
           for f in dataclasses.fields(cls) if hasattr(f.metadata["options"].get("type"), "in_range")]


def test_a_batch_of_no_clips_is_refused_in_one_line():
    with pytest.raises(OutOfRange) as refused:
        config.Data(data="set", batch_size=0)
    assert str(refused.value) == "--batch-size: 0 is out of range: give 1 or more"
    assert isinstance(refused.value, UsageError) and isinstance(refused.value, ValueError)


@pytest.mark.parametrize("cls, field", CHECKED, ids=[f"{c.__name__}.{f.name}" for c, f in CHECKED])
def test_every_ranged_field_refuses_in_python_what_its_flag_refuses(cls, field, capsys):
    option = "--" + field.name.replace("_", "-")
    bad = -1 if field.metadata["options"]["type"].__name__ == "int" else -1.0
    with pytest.raises(OutOfRange) as refused:
        cls(**REQUIRED.get(cls, {}), **{field.name: (bad,) if field.metadata["options"].get("nargs")
                                        else bad})
    argv = [*(["--data", "set"] if cls in REQUIRED else []), option, str(bad)]
    with pytest.raises(SystemExit):
        config.parser(PARSERS.get(cls, config.add_train_arguments)).parse_args(argv)
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"argument {str(refused.value)}")


def test_the_fields_a_checkpoint_stores_are_checked_too():
    with pytest.raises(OutOfRange, match="--width: 0 is out of range"):
        config.TrainConfig.from_dict({"version": 1, "data": {"data": "set"}, "model": {"width": 0},
                                      "recipe": {}, "system": {}, "schedules": {}})
    assert len(CHECKED) >= 20  # the ranges this file holds the configs to


def test_a_validation_scale_below_the_crop_is_refused_naming_both_flags():
    """Validation scales the short side to --scale-size, then cuts a --crop-size crop: the loader refuses a
    scale below the crop (``ValueError``), the trainer's flags first, in their words."""
    with pytest.raises(OutOfRange) as refused:
        config.Data(data="set", crop_size=128, scale_size=64)
    assert str(refused.value).startswith("--scale-size 64: smaller than --crop-size 128")
    assert "--val-split ''" in str(refused.value)
    config.Data(data="set", crop_size=128, scale_size=64, val_split="")  # no validation: only crops are cut
    with pytest.raises(OutOfRange, match="--lookahead: -1 is out of range: give 0 or more"):
        config.Data(data="set", lookahead=-1)
