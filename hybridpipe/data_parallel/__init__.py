"""Data parallelism: Horovod's DistributedOptimizer and broadcasts (optimizer), ZeRO sharding (zero),
SyncBatchNorm, the fp16 loss scaler (amp), the gradient
compressors (compression) and elastic training (elastic). ``import hybridpipe as hp`` gives their public names."""
