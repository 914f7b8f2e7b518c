"""The cuda backend's Python side: its kernels are the compiled extension macs_kernels._C's (csrc/), registered
for the operators `torch.ops.macs_kernels.<op>`; `emulation` runs the same sources on the CPU.

The split-KV ops (decode_attention, macs_update, macs_pool, macs_pool_paged) launch one of three first passes,
chosen by shape (SplitKernel in csrc/split_kv/policy.cuh), the fastest that takes it and whose block fits the GPU's
shared memory: the tensor-core kernel (csrc/split_kv_mma) for fp16/bf16 inputs with D 64 or 128, D_v == D,
H / H_kv <= 16 and 16-byte aligned K/V rows on sm_80 and later (on GPUs with 99 KB a block, decode_attention at
D 128 runs the next); else the pipelined kernel (csrc/split_kv_pipelined) for 16-byte aligned rows of D / 16 bytes
a power of two up to 32, D_v == D and (H / H_kv) * D / 16 bytes <= 256 (float32 among them); else split_kernel
(csrc/split_kv) for the other shapes the ops accept.
Importing this package loads no extension.
"""
