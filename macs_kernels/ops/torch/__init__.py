"""Torch backend of the ops: vectorised PyTorch kernels that run on any device; each is its operator's
default kernel and the reference the other backends are checked against."""
