"""Lightning callbacks: ``CompressionMonitor`` logs the compression of every training step under ``act/``."""
from .monitor import CompressionMonitor

__all__ = ["CompressionMonitor"]
