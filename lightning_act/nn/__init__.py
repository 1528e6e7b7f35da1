"""Modules that save memory by changing how layers execute (LR-CNN row-centric stacks, BLPA blocks, a GCN layer
and a ReLU+dropout whose backward holds two node-sized tensors)."""

from lightning_act.nn.blpa import BNReLUBlock, convert_bn_relu
from lightning_act.nn.relu_dropout import ReLUDropout
from lightning_act.nn.row_centric import Residual, RowCentric, wrap_conv_trunks
from lightning_act.nn.row_plan import RowPlan
from lightning_act.nn.sparse_gcn import SparseGCNConv

__all__ = ["BNReLUBlock", "ReLUDropout", "Residual", "RowCentric", "RowPlan", "SparseGCNConv", "convert_bn_relu",
           "wrap_conv_trunks"]
