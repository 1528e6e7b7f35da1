"""Modules that save memory by changing how layers execute (LR-CNN row-centric stacks, BLPA blocks, a GCN layer,
a ReLU+dropout whose backward holds two node-sized tensors, Conv-BN-ReLU runs, residual merges and Linear ->
activation pairs whose backwards hold two full tensors)."""

from lightning_act.nn.blpa import BNReLUBlock, convert_bn_relu
from lightning_act.nn.bounded_cnn import (BoundedSequential, ResidualReLU, conv_bn_act, convert_bounded_cnn,
                                          unconvert_bounded_cnn)
from lightning_act.nn.bounded_ffn import convert_bounded_ffn, is_bounded_ffn, linear_act, unconvert_bounded_ffn
from lightning_act.nn.relu_dropout import ReLUDropout
from lightning_act.nn.row_centric import Residual, RowCentric, wrap_conv_trunks
from lightning_act.nn.row_plan import RowPlan
from lightning_act.nn.sparse_gcn import SparseGCNConv

__all__ = ["BNReLUBlock", "BoundedSequential", "ReLUDropout", "Residual", "ResidualReLU", "RowCentric", "RowPlan",
           "SparseGCNConv", "conv_bn_act", "convert_bn_relu", "convert_bounded_cnn", "convert_bounded_ffn",
           "is_bounded_ffn", "linear_act", "unconvert_bounded_cnn", "unconvert_bounded_ffn", "wrap_conv_trunks"]
