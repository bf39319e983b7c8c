"""CPU-only speed work for the development path: C kernels, oneDNN layers, host memory.

Applied to a built (unsharded, usually `meta`) model from outside, the way sharding is, by
one call on CPU hosts only: `accelerate(model, config.cpu, precision)`. GPU hosts never
import the kernels here and train TorchRec's own modules.
"""

from training.cpu.accelerate import CpuKernels, accelerate

__all__ = ["CpuKernels", "accelerate"]
