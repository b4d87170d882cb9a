"""Device-side math of one verification step: Triton kernels, each with a PyTorch reference."""
