"""Fast paths, each beside the torch reference it must match: native C kernels for CPU (csrc/,
built at first use), Triton kernels for GPU, and the choice among them at start."""
