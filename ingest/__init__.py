"""Kinetics videos to pre-sampled JPEG-clip WebDataset shards, decoded by ffmpeg on Ray."""
