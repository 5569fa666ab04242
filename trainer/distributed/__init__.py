"""The distributed room: the data-parallel backends (``backends``: Horovod, torch.distributed, none)
behind one small interface. Imports nothing else of the trainer.
"""
