"""The KV budget: what one position of a row's cache costs, what rows can reach, and the budget by default.

The batch engine admits a row only while the bound on the padded cache
(rows x the longest reserved length) stays within the budget; the prefix
cache lives in what the rows leave of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from workers.backends.onnx.graph import GraphSpec
from workers.backends.onnx.session import cuda_free_bytes


def kv_bytes_per_position(graph: GraphSpec) -> int:
    """Cache bytes one position of one row takes: layers x (key + value) x heads x head size x element."""
    return len(graph.past_names) * graph.kv_heads * graph.head_dim * np.dtype(graph.kv_dtype).itemsize


def reserved_bytes(length_caps: Sequence[int], bytes_per_position: int) -> int:
    """The bound on the padded cache rows of these length caps can reach: rows x the longest, per position."""
    if not length_caps:
        return 0
    return len(length_caps) * max(length_caps) * bytes_per_position


def automatic_kv_budget(device_type: str, device_id: int, *, share: float) -> int:
    """``share`` of the free memory of the model's device (CUDA) or of the host's physical memory (CPU)."""
    if device_type == "cuda":
        free = cuda_free_bytes(device_id)
        if free:
            return int(free * share)
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
    return int(physical * share)
