"""Packed documents (--document_masking): how many a training window keeps apart by default.

The model's attention, the data pipeline, packing and the settings read it; it lives outside
model/ so that data preparation (data/pack.py) reads it without importing jax.
"""

# cuDNN's packed attention costs per segment slot, used or not, in time and in its backward's
# workspace (which grows with segments x tokens). On one H200, the 1B's attention forward +
# backward at 8 x 2048: 8 slots 1.19 ms, 32 slots 1.88, 128 slots 4.52, against 1.67 for causal
# attention over whole windows; at 2 x 8192: 32 slots 2.0 ms, 128 slots 4.3, against 4.9. Its
# whole step at 2 x 8192: 1.20x the causal step's tokens/s with 32 slots and 3.3 GiB more, 1.09x
# with 128 slots and 30 GiB more.
DOCUMENTS_PER_WINDOW = 32
