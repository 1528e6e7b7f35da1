"""Modules that save memory by changing how layers execute (LR-CNN row-centric stacks, BLPA blocks)."""

from lightning_act.nn._row_plan import RowPlan
from lightning_act.nn.row_centric import Residual, RowCentric
from lightning_act.nn.blpa import BNReLUBlock, convert_bn_relu  # noqa: F401

__all__ = ["Residual", "RowCentric", "RowPlan"]
