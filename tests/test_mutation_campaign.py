"""The shard-set mutation campaign (issue 37): hundreds of damaged copies of one small sound set,
each made by a seeded mutator (tests/helpers/mutations.py: tar bytes flipped, cut, inserted, duplicated or
zeroed, tar headers rewritten, members deleted, shards swapped, with or without the manifest made
to match; manifest fields deleted, retyped, scaled, negated, repointed outside the set, ranges
shifted, its JSON broken), given in-process to ``shards verify``, ``shards stats``, ``shards
preview``, one epoch of ``ClipLoader`` and (every fourth copy) the viewer's routes, in a forked
child under an address-space limit and a per-tool alarm.

The properties: no traceback (only ``CommandError`` refusals, exit status 0, 1 or 2; no bare 500
from the viewer), no hang, no child killed for memory, verify refuses every copy a reader refuses,
nothing opened or connected to outside the copy. A finding is named by its signature (the tool,
the exception's type, the file and function it was raised in); the campaign fails on any finding.
``FIXED`` is the corpus of the bugs the campaign found, each with the seed that first showed it and
regenerated from it as a regression case (a bug found later is fixed, then added there).
docs/benchmarks/mutation-campaign.md has the figures and the command."""
from __future__ import annotations

import os

import pytest
from helpers import mutations
from helpers.shardsets import make_shardset

COPIES = 500
LONG_COPIES = 5000

# bug -> (the signatures it showed as, the first seed that showed it), for the bugs the campaign found, all
# fixed
FIXED = {
    "the viewer answers a reader's one-line refusal with a bare 500": (
        ["viewer: refusal answered 500 in BadManifest", "viewer: refusal answered 500 in ShortShard",
         "viewer: refusal answered 500 in CorruptSample", "viewer: refusal answered 500 in BadSample"], 0),
    "a truncated JPEG frame is a PIL OSError traceback in preview": (
        ["preview: OSError in ImageFile.py:_safe_read"], 386),
    "verify (not --deep) passes a frame whose JPEG header does not parse; stats and the loader refuse it": (
        ["verify passed what stats refused", "verify passed what loader refused",
         "verify passed what preview refused"], 570),
    "a shard cut short is an EOFError traceback in stats, preview, the loader and the viewer": (
        ["stats: EOFError in shards/format/digests.py:_sample",
         "preview: EOFError in shards/format/digests.py:_sample",
         "loader: EOFError in shards/format/digests.py:_sample"], 70),
    "a damaged tar header is a tarfile.ReadError traceback in the readers": (
        ["stats: ReadError in tarfile.py:next", "loader: ReadError in tarfile.py:next"], 29),
    "a tar header's huge size is an OverflowError traceback, verify included": (
        ["verify: OverflowError in tarfile.py:next", "stats: OverflowError in tarfile.py:next",
         "preview: OverflowError in tarfile.py:next", "viewer: OverflowError in tarfile.py:next"], 156),
    "a sample key in the tar other than the manifest's is a ValueError in the loader": (
        ["loader: ValueError in trainer/data/stages.py:tag"], 43),
    "a cls member that is not a number is a ValueError in the loader": (
        ["loader: ValueError in trainer/data/stages.py:<listcomp>"], 193),
    "a sample with fewer frames than the set's is an IndexError in the loader's transform": (
        ["loader: IndexError in trainer/data/transforms.py:into"], 73),
    "a truncated JPEG frame is a PIL traceback in stats and the loader": (
        ["stats: OSError in ImageFile.py:_safe_read", "loader: OSError in ImageFile.py:_safe_read"], 386),
    "an undecodable JPEG frame is a PIL UnidentifiedImageError traceback in stats": (
        ["stats: UnidentifiedImageError in Image.py:open"], 353),
}


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("campaign"))
    sound = os.path.join(root, "sound")
    make_shardset(sound, {"train": 6, "val": 2}, per_shard=3, frames=2, size=(32, 24))
    make_shardset(os.path.join(root, "other"), {"train": 3}, per_shard=3, frames=2, size=(32, 24))  # a bait
    return mutations.Campaign(mutations.Sound.of(sound), root)


def _findings(outcomes) -> list[str]:
    return [f"seed {o.seed} {o.changes}: {line}" for o in outcomes for sig, line in o.findings().items()]


def _run(campaign, seeds) -> None:
    outcomes = campaign.run(list(seeds))
    assert len(outcomes) == len(seeds)
    refused = sum(bool(o.tools["verify"].get("refused")) for o in outcomes)
    assert refused > len(seeds) // 2, f"verify refused only {refused} of {len(seeds)} copies: a blunt mutator"
    unknown = _findings(outcomes)
    assert not unknown, f"{len(unknown)} findings:\n" + "\n".join(unknown[:40])


def test_the_sound_set_passes_every_tool(campaign):
    outcome = campaign.run([mutations.SOUND])[0]
    assert outcome.changes == [] and not outcome.findings()
    assert not any(o.get("refused") for o in outcome.tools.values()), outcome.tools


def test_every_tool_answers_500_damaged_copies_in_a_line_and_verify_first(campaign):
    _run(campaign, range(COPIES))


@pytest.mark.long
def test_every_tool_answers_5000_more_damaged_copies(campaign):
    _run(campaign, range(COPIES, COPIES + LONG_COPIES))


@pytest.mark.parametrize("bug", FIXED)
def test_corpus_fixed_bug(campaign, bug):
    signatures, seed = FIXED[bug]
    found = campaign.run([seed])[0].findings()
    assert not set(found) & set(signatures), found


def test_the_campaign_survives_a_parent_that_ran_parallel_torch_ops(campaign):
    """The forked child must not enter the parent's OpenMP pool (seen under -n 2: earlier tests in the
    pytest process had run parallel ops, and the child segfaulted in SlotPool's first copy)."""
    import torch
    torch.ones(10_000_000).add_(1).sum()  # start this process's OpenMP pool, as those tests did
    # no config.clip.frames: the loader's slots large enough for a parallel copy
    outcome = campaign.run([1119])[0]
    assert outcome.changes and not outcome.findings(), outcome.findings()
