"""The model room: TSM and TSN on a ResNet (``tsm``, ``resnet``), the temporal shift (``temporal_shift``),
sub-batch BN (``subbatch_bn``) and ``torch.compile`` (``compiling``). Imports nothing else of the trainer.
"""
