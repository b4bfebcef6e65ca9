"""The kernels the models call, one module per family, each beside its PyTorch reference; the
launch helpers they share (launch.py) and the policy that picks between them (policy.py)."""

from .policy import KERNELS, PATHS, REFERENCE, KernelPolicy, apply_policy

__all__ = ["KERNELS", "PATHS", "REFERENCE", "KernelPolicy", "apply_policy"]
