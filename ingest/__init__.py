"""Kinetics videos to pre-sampled JPEG-clip WebDataset shards, decoded on Ray or in local processes.

``build`` runs a build (``build_cli`` its command line, ``registry`` the catalog's wrapper,
``outdir`` what ``--out`` may hold); ``sources`` lists the videos, ``staging`` and ``clips`` make
each video's samples (``sampling`` picks the frames, ``jpeg`` encodes them), ``content_digests``
identifies the inputs, ``synth`` makes videos to try it on. Beneath them, ``decode`` (the decoders,
one entry each in ``decode.DECODERS``) and ``tasks`` (where the tasks run) import nothing of the
build.
"""
