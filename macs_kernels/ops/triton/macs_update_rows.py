"""macs_update_rows in Triton: each head's generated mass, then the head pooling into log_c."""
from __future__ import annotations

from macs_kernels.ops.triton.pool import generated_mass, pool


def macs_update_rows(rows, log_c, input_start, input_end, kv_len, alpha, pooling, redistribute):
    """rows (B, H, S) any float dtype; log_c (B, N_max) float32 updated in place."""
    mass = generated_mass(rows, input_end, kv_len) if redistribute else None
    pool(rows, log_c, input_start[:, None], input_end[:, None], kv_len[:, None], rows.shape[2], generated=mass,
         alpha=alpha, pooling=pooling, redistribute=redistribute)
