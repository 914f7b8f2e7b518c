"""Per-dtype tolerances, one table for every kernel test: max |got - ref| / max |ref| against float64."""
import torch

RELATIVE_ERROR = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.detach().double().cpu()
    ref = ref.detach().double().cpu()
    scale = ref.abs().max().clamp_min(1e-30)
    return ((got - ref).abs().max() / scale).item()
