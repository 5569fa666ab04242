"""The model room: TSM, TSN and the I3D baselines on a ResNet (``tsm``, ``resnet``, ``i3d``), the temporal
shift (``temporal_shift``), sub-batch BN (``subbatch_bn``) and ``torch.compile`` (``compiling``). Imports
nothing else of the trainer but its base (``trainer.config``).
"""
