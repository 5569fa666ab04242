"""The TSM trainer (Horovod) and the streaming WebDataset clip loader that feeds it."""
