"""DLRM models, TorchRec sharding, the distributed trainer and its torchrun launcher."""
