"""Modules that save memory by changing how layers execute (LR-CNN row-centric stacks, BLPA blocks)."""

from lightning_act.nn.blpa import BNReLUBlock, convert_bn_relu
from lightning_act.nn.row_centric import Residual, RowCentric, wrap_conv_trunks
from lightning_act.nn.row_plan import RowPlan

__all__ = ["BNReLUBlock", "Residual", "RowCentric", "RowPlan", "convert_bn_relu", "wrap_conv_trunks"]
