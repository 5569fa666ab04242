"""The data room: shards -> uint8 clip batches (B, T, C, H, W) on every rank.

``loader`` (the streaming ``ClipLoader``), ``transforms`` (TSM's crops, JPEG decoding), ``cropdecode``
(the C crop decoder, ``trainer/libcropjpeg.so``), ``device_decode`` (nvJPEG on the GPU), ``slots`` (the
shared-memory batch pool) and ``shapes`` (a multigrid epoch's batches cut into parts; ``EpochShapes``,
what the loader needs of a schedule). Imports nothing of the trainer outside this room.
"""
