"""Modules that save memory by changing how layers execute (LR-CNN row-centric stacks, BLPA blocks)."""
