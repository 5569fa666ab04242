"""The decoder registry (``ingest.decode.DECODERS``) is the one list of decoders: a new entry is
taken by ``ClipConfig``, ``ingest build --decoder`` and the service's build requests alike, and
its fallback rule sends a video it cannot open to the decoder it names, with the real decoders
on a real video."""
from __future__ import annotations

import argparse

import pytest
from helpers.media import make_video

from ingest.build_cli import add_arguments
from ingest.clips import ClipConfig, make_clips
from ingest.decode import DECODERS, Decoder
from ingest.decode.video import DecodeError
from ingest.sources import Video
from service.builds import BadRequest, parse_body


def _video(path) -> Video:
    return Video("train", f"train/a/{path.name}", str(path), "a", path.stem, path.stat().st_size, "file")


def _refusing(reason: str):
    def decode(path, wanted, short_side, *, threads, deadline, motion_vectors):
        raise DecodeError(reason)
    return decode


@pytest.fixture
def video(tmp_path):
    return _video(make_video(tmp_path / "v.mp4", frames=12))


def test_a_new_entry_is_a_decoder_everywhere_and_falls_back_as_its_entry_says(video, monkeypatch):
    monkeypatch.setitem(DECODERS, "fussy", Decoder(_refusing("no frame decodes: fussy"), fallback="ffmpeg",
                                                   fallback_reasons=("no frame decodes",)))
    clips, _ = make_clips(video, 0, ClipConfig(frames=4, short_side=32, decoder="fussy"))
    assert [c[0] for c in clips] == ["v_c00"] and b'"decoder": "ffmpeg"' in clips[0][2]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--src", "SRC", "--out", "OUT", "--decoder", "fussy"]).decoder == "fussy"
    assert parse_body({"src": "/videos", "decoder": "fussy"}, max_workers=1)["cfg"].decoder == "fussy"


def test_a_refusal_outside_the_fallback_reasons_is_the_decoders_own(video, monkeypatch):
    monkeypatch.setitem(DECODERS, "fussy", Decoder(_refusing("unsupported: fussy"), fallback="ffmpeg",
                                                   fallback_reasons=("no frame decodes",)))
    with pytest.raises(DecodeError, match="unsupported: fussy"):
        make_clips(video, 0, ClipConfig(frames=4, short_side=32, decoder="fussy"))


def test_the_real_registry_falls_back_from_pyav_to_the_command_line_only(video):
    assert DECODERS["pyav"].fallback == "ffmpeg" and DECODERS["ffmpeg"].fallback is None
    clips, _ = make_clips(video, 0, ClipConfig(frames=4, short_side=32))
    assert b'"decoder": "pyav"' in clips[0][2]


def test_a_decoder_not_in_the_registry_and_mv_without_vectors_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"decoder must be one of \('pyav', 'ffmpeg'\), not 'nope'"):
        ClipConfig(decoder="nope")
    with pytest.raises(ValueError, match="motion 'mv' needs decoder 'pyav' \\('ffmpeg' does not export"):
        ClipConfig(decoder="ffmpeg", motion="mv")
    with pytest.raises(BadRequest, match="decoder must be one of pyav, ffmpeg"):
        parse_body({"src": "/videos", "decoder": "nope"}, max_workers=1)
