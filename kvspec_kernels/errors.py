"""Typed errors of the kernel launchers: a bad shape or dtype is a caller bug, reported before launch."""
from __future__ import annotations


class KernelArgumentError(ValueError):
    """An argument of a kernel launcher has the wrong shape, dtype, device or layout."""
