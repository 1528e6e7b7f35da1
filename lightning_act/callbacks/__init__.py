"""Lightning callbacks: ``CompressionMonitor`` logs the compression of every training step under ``act/``;
``AutoPrecision`` re-estimates per-tensor bits (GACT); ``ErrorBoundCallback`` adapts per-layer ``lorenzo`` error
bounds from the optimizer's momentum (Jin et al.); ``MemoryBudget`` plans per-block compression,
checkpointing and swapping to meet a step's memory budget."""
from .auto_precision import AutoPrecision
from .error_bound import ErrorBoundCallback
from .memory_budget import MemoryBudget
from .monitor import CompressionMonitor

__all__ = ["AutoPrecision", "CompressionMonitor", "ErrorBoundCallback", "MemoryBudget"]
