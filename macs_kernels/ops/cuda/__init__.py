"""The cuda backend's Python side: its kernels are the compiled extension macs_kernels._C's (csrc/), registered
for the operators `torch.ops.macs_kernels.<op>`; `emulation` runs the same sources on the CPU.

The split-KV ops (decode_attention, macs_update, macs_pool, macs_pool_paged) launch one of three first passes,
chosen by shape (SplitKernel in csrc/split_kv/policy.cuh): the tensor-core kernel (csrc/split_kv_mma) for fp16/bf16
inputs with D 64 or 128, D_v == D, H / H_kv <= 16 and 16-byte aligned K/V rows on sm_80 and later; else the
pipelined kernel (csrc/split_kv_pipelined) for 16-byte aligned rows of D / 16 bytes a power of two up to 32,
D_v == D and (H / H_kv) * D / 16 bytes <= 256 (float32 among them); else split_kernel (csrc/split_kv), which takes
any shape the ops accept. A CUDA graph keeps the kernel it captured.
Importing this package loads no extension.
"""
