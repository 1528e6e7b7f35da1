"""A GCN layer over a sparse adjacency whose backward holds two node-sized tensors (issue #17, item 3).

PyG's ``GCNConv`` over a CSR ``adj_t`` computes ``adj_t @ (x @ W^T) + b`` as two autograd ops. Their backward
holds, for one layer, the incoming gradient, the sparse product's gradient, the decoded input, the input's
gradient (and the ReLU/dropout gradients after them): about five node-sized tensors that are not saved
activations, so compressing the activations leaves them where they are and they set a step's peak.

:class:`SparseGCNConv` computes the same function in one ``torch.autograd.Function``:

- forward: ``(A[rows] @ x) @ W^T`` per row chunk into one output when ``in <= out`` (no node-sized
  intermediate), else ``A @ (x @ W^T)`` (the intermediate is the smaller side); ``x`` is saved as row chunks,
  each of which the saved-tensor hooks (the compressor) pack separately;
- backward, per row chunk: ``T = (A^T)[rows] @ G``, ``grad_W += T^T @ x[rows]``, ``grad_x[rows] = T @ W``,
  written into one preallocated ``grad_x``; one decoded chunk of ``x`` is alive at a time. So the backward
  holds ``G`` and ``grad_x`` plus chunk-sized temporaries.

``A^T`` is computed once per adjacency (the layer caches it beside the normalized adjacency); when ``A`` is
symmetric (the normalized adjacency of an undirected graph) it is ``A`` itself and costs nothing.
Normalization is PyG's ``gcn_norm``, imported when used (``pip install 'lightning-act[gnn]'``).
"""
from __future__ import annotations

import math
import weakref

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .._validate import check_int
from ._chunks import DEFAULT_CHUNK_BYTES, SavedEntries, chunk_rows, row_bounds

__all__ = ["SparseGCNConv", "csr_rows", "csr_transpose", "gcn_adjacency", "normalized_adjacency", "sparse_gcn"]


def csr_rows(adj: torch.Tensor, start: int, stop: int, nnz_start: int, nnz_stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of CSR ``adj`` (its entries ``[nnz_start, nnz_stop)``), sharing its index and value
    storage (only the ``stop - start + 1`` row pointers are new)."""
    crow = adj.crow_indices()[start:stop + 1] - nnz_start
    return torch.sparse_csr_tensor(crow, adj.col_indices()[nnz_start:nnz_stop], adj.values()[nnz_start:nnz_stop],
                                   (stop - start, adj.shape[1]))


def _row_chunks(adj: torch.Tensor, bounds: list[tuple[int, int]]):
    """``(start, stop, rows of adj)`` per chunk; one host read of the row pointers for all chunks."""
    crow = adj.crow_indices()
    offsets = crow[[s for s, _ in bounds] + [bounds[-1][1]]].tolist() if bounds else []
    for i, (start, stop) in enumerate(bounds):
        yield start, stop, csr_rows(adj, start, stop, offsets[i], offsets[i + 1])


def csr_transpose(adj: torch.Tensor) -> torch.Tensor:
    """``adj^T`` as a CSR tensor, or ``adj`` itself when it is symmetric (same pattern and values), so the
    transposed product of a symmetric adjacency costs no second copy."""
    t = adj.transpose(0, 1).to_sparse_csr()
    if (t.shape == adj.shape and torch.equal(t.crow_indices(), adj.crow_indices())
            and torch.equal(t.col_indices(), adj.col_indices()) and torch.equal(t.values(), adj.values())):
        return adj
    return t


class _SparseGCN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, adj, adj_transposed, rows):
        n, (out_channels, in_channels) = x.shape[0], weight.shape
        bounds = row_bounds(n, rows)
        if in_channels <= out_channels:
            out = x.new_empty(n, out_channels)
            for start, stop, a in _row_chunks(adj, bounds):
                torch.mm(torch.sparse.mm(a, x), weight.t(), out=out[start:stop])
        else:
            out = torch.sparse.mm(adj, x @ weight.t())
        if bias is not None:
            out.add_(bias)
        ctx.bounds, ctx.x_shape, ctx.has_bias = bounds, x.shape, bias is not None
        # the weight's gradient reads x. detach(): a view made here (grad mode off) of a tensor that requires
        # grad looks like a leaf to the compressor, which keeps leaves (parameters) as they are
        chunks = x.detach().split(rows) if ctx.needs_input_grad[1] else ()
        ctx.save_for_backward(weight, adj_transposed, *chunks)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_out = grad_out.contiguous()
        saved = SavedEntries(ctx)
        weight, adj_transposed = saved[0], saved[1]
        grad_x = grad_out.new_empty(ctx.x_shape) if need_x else None
        grad_w = torch.zeros_like(weight) if need_w else None
        if need_x or need_w:
            for i, (start, stop, a) in enumerate(_row_chunks(adj_transposed, ctx.bounds)):
                t = torch.sparse.mm(a, grad_out)  # rows of A^T G
                if need_w:
                    grad_w.addmm_(t.t(), saved[2 + i])
                if need_x:
                    torch.mm(t, weight, out=grad_x[start:stop])
        grad_b = grad_out.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None


def sparse_gcn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, adj: torch.Tensor,
               adj_transposed: torch.Tensor, rows: int) -> torch.Tensor:
    """``adj @ (x @ weight^T) + bias`` with a backward that holds one decoded ``rows``-row chunk of ``x`` at a
    time (module docstring). ``adj`` and ``adj_transposed``: CSR tensors, the second ``adj^T``
    (:func:`csr_transpose`); ``weight``: ``(out, in)`` as in ``nn.Linear``."""
    if adj.layout != torch.sparse_csr or adj_transposed.layout != torch.sparse_csr:
        raise TypeError(f"adj and adj_transposed must be sparse CSR tensors; got {adj.layout} and "
                        f"{adj_transposed.layout}")
    return _SparseGCN.apply(x, weight, bias, adj, adj_transposed, rows)


def gcn_adjacency(edge_index: torch.Tensor, edge_weight: torch.Tensor | None, num_nodes: int, dtype: torch.dtype,
                  improved: bool = False, add_self_loops: bool = True, normalize: bool = True) -> torch.Tensor:
    """The CSR matrix ``GCNConv`` aggregates with (``adj[target, source]``), normalized by PyG's ``gcn_norm`` as
    ``GCNConv`` does for the same input: a sparse ``adj_t`` (torch CSR or COO) or an ``edge_index`` with
    optional ``edge_weight`` (flow source to target)."""
    sparse = edge_index.layout != torch.strided
    if normalize or not sparse:
        try:
            from torch_geometric.nn.conv.gcn_conv import gcn_norm
            from torch_geometric.utils import to_torch_csr_tensor
        except ImportError as e:
            raise ImportError("SparseGCNConv normalizes with torch_geometric's gcn_norm: "
                              "pip install 'lightning-act[gnn]'") from e
    if sparse:
        adj = edge_index.to_sparse_csr() if edge_index.layout != torch.sparse_csr else edge_index
        if normalize:
            adj, _ = gcn_norm(adj, None, num_nodes, improved, add_self_loops, "source_to_target", dtype)
    else:
        if normalize:
            edge_index, edge_weight = gcn_norm(edge_index, edge_weight, num_nodes, improved, add_self_loops,
                                               "source_to_target", dtype)
        adj = to_torch_csr_tensor(edge_index.flip(0), edge_weight, size=(num_nodes, num_nodes))
    return adj.to(dtype) if adj.dtype != dtype else adj


def _version(t: torch.Tensor) -> int:
    """The version counter of ``t``'s values (a sparse tensor's own counter does not see in-place edits)."""
    if t.layout == torch.sparse_csr:
        t = t.values()
    elif t.layout == torch.sparse_coo:
        t = t._values()
    return t._version


# input adjacency -> {(num_nodes, dtype, improved, add_self_loops, normalize): (edge_weight, versions, A, A^T)}.
# Weakly keyed: an entry lives as long as the adjacency it was computed from; A or A^T that *is* the key (an
# adjacency used as it is) is stored as None, so the value does not keep its own key alive.
_ADJACENCIES = WeakIdKeyDictionary()


def normalized_adjacency(edge_index: torch.Tensor, edge_weight: torch.Tensor | None, num_nodes: int,
                         dtype: torch.dtype, improved: bool = False, add_self_loops: bool = True,
                         normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, A^T)``: :func:`gcn_adjacency` and :func:`csr_transpose` of it, computed once per input adjacency
    (tensor object and version of its values, ``edge_weight`` likewise) and options, and shared by every layer
    given that adjacency: a deep GCN holds one normalized copy and one transpose, not one per layer."""
    if not isinstance(edge_index, torch.Tensor):
        raise TypeError(f"expected a torch sparse adj_t or an edge_index tensor; got {type(edge_index).__name__} "
                        "(a torch_sparse SparseTensor converts with .to_torch_sparse_csr_tensor())")
    options = (num_nodes, dtype, improved, add_self_loops, normalize)
    versions = (_version(edge_index), None if edge_weight is None else _version(edge_weight))
    entries = _ADJACENCIES.setdefault(edge_index, {})
    hit = entries.get(options)
    if hit is not None and hit[0]() is edge_weight and hit[1] == versions:
        return tuple(edge_index if t is None else t for t in hit[2:])
    adj = gcn_adjacency(edge_index, edge_weight, num_nodes, dtype, improved, add_self_loops, normalize)
    adj_transposed = csr_transpose(adj)
    entries[options] = (weakref.ref(edge_weight) if edge_weight is not None else lambda: None, versions,
                        *(None if t is edge_index else t for t in (adj, adj_transposed)))
    return adj, adj_transposed


class SparseGCNConv(nn.Module):
    """Drop-in for ``torch_geometric.nn.GCNConv`` (same arguments and parameter names: a ``GCNConv`` state dict
    loads) whose backward holds the incoming and outgoing gradients plus ``chunk_bytes``-sized temporaries
    instead of about five node-sized tensors (module docstring).

    ``forward(x, edge_index, edge_weight=None)``: ``edge_index`` a sparse ``adj_t`` (``adj[target, source]``, a
    torch CSR or COO tensor) or an ``edge_index``; the normalized CSR adjacency and its transpose are computed
    once per adjacency and shared by the layers given it (:func:`normalized_adjacency`); with ``cached=True``
    the layer keeps the first ones whatever it is given later, as ``GCNConv`` does.
    ``chunk_bytes``: the most bytes of one row chunk (of the input or output, the wider), an int or a size
    such as ``"4MiB"``; smaller chunks mean smaller backward temporaries and more, smaller saved tensors."""

    def __init__(self, in_channels: int, out_channels: int, improved: bool = False, cached: bool = False,
                 add_self_loops: bool | None = None, normalize: bool = True, bias: bool = True,
                 chunk_bytes: int | str = DEFAULT_CHUNK_BYTES):
        super().__init__()
        check_int("in_channels", in_channels, minimum=1)
        check_int("out_channels", out_channels, minimum=1)
        if add_self_loops is None:
            add_self_loops = normalize
        if add_self_loops and not normalize:
            raise ValueError("add_self_loops=True needs normalize=True (as in GCNConv)")
        chunk_rows(chunk_bytes, 1)  # validate now, not at the first forward
        self.in_channels, self.out_channels = in_channels, out_channels
        self.improved, self.cached, self.add_self_loops, self.normalize = improved, cached, add_self_loops, normalize
        self.chunk_bytes = chunk_bytes
        self.lin = nn.Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self._cached: tuple[torch.Tensor, torch.Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot weight and zero bias (``GCNConv``'s initialisation); forgets the cached adjacency."""
        bound = math.sqrt(6.0 / (self.in_channels + self.out_channels))
        nn.init.uniform_(self.lin.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        self._cached = None

    def adjacency(self, edge_index: torch.Tensor, edge_weight: torch.Tensor | None, num_nodes: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, A^T)`` for this input (:func:`normalized_adjacency`; with ``cached=True`` the first ones, kept)."""
        if self.cached and self._cached is not None:
            return self._cached
        pair = normalized_adjacency(edge_index, edge_weight, num_nodes, dtype, self.improved, self.add_self_loops,
                                    self.normalize)
        if self.cached:
            self._cached = pair
        return pair

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, edge_weight: torch.Tensor | None = None):
        adj, adj_transposed = self.adjacency(edge_index, edge_weight, x.shape[0], x.dtype)
        rows = chunk_rows(self.chunk_bytes, max(self.in_channels, self.out_channels) * x.element_size(), x.shape[0],
                          x.device)
        return sparse_gcn(x, self.lin.weight, self.bias, adj, adj_transposed, rows)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, chunk_bytes={self.chunk_bytes}"
