"""Op rules that keep a gradient right: saved values a backward compares (a reduction's winners) or divides by are
stored exactly, whatever the codec; ``compress_masks=False`` keeps these rules (``op_rules.GRADIENT_RULE_FUNCTIONS``).

Rounded apart, an amax's saved input no longer equals its saved result: its backward divides the gradient by a
count of 0 (NaN everywhere) or gives it to no element. A torch_geometric max aggregation (``scatter_reduce_``
with ``"amax"``) trained to NaN gradients this way."""
import math

import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.codecs import op_rules
from lightning_act.stats import COMPRESSED, DUPLICATE

torch.manual_seed(0)
_INDEX = torch.randint(0, 50, (512,))
_TARGET = torch.rand(512, 32) * 0.98 + 0.01
_COLUMNS = _INDEX[:, None].expand(-1, 32)

# op name -> a loss of h (512 x 32, every value distinct) whose backward compares or divides by h or its result
COMPARING = {
    "torch.amax": lambda h: torch.amax(h, dim=1).sum(),
    "Tensor.amin": lambda h: h.amin(dim=0).sum(),
    "Tensor.max()": lambda h: h.max() * 2,
    "torch.min()": lambda h: torch.min(h) * 2,
    "torch.median()": lambda h: torch.median(h) * 2,
    "scatter_reduce_ amax": lambda h: h.new_zeros(50, 32).scatter_reduce_(0, _COLUMNS, h, "amax",
                                                                         include_self=False).sum(),
    "torch.scatter_reduce amin": lambda h: torch.scatter_reduce(h.new_zeros(50, 32), 0, _COLUMNS, h, reduce="amin",
                                                                include_self=False).sum(),
    "scatter_reduce prod": lambda h: h.new_ones(50, 32).scatter_reduce(0, _COLUMNS, h, "prod").sum(),
    "index_reduce_ amax": lambda h: h.new_zeros(50, 32).index_reduce_(0, _INDEX, h, "amax",
                                                                      include_self=False).sum(),
    "linalg.vector_norm inf": lambda h: torch.linalg.vector_norm(h, ord=float("inf"), dim=1).sum(),
    "Tensor.norm(p=-inf)": lambda h: h.norm(p=-float("inf"), dim=0).sum(),
    "linalg.matrix_norm inf": lambda h: torch.linalg.matrix_norm(h.view(16, 32, 32), ord=float("inf")).sum(),
    "torch.prod": lambda h: torch.prod(h[:, :6], dim=1).sum(),
    "Tensor.cumprod": lambda h: h[:, :6].cumprod(dim=1).sum(),
    # (h + 10: positive, and an add saves nothing)
    "torch.sqrt": lambda h: torch.sqrt(h + 10).sum(),
    "Tensor.rsqrt": lambda h: (h + 10).rsqrt().sum(),
    "1 / h": lambda h: (1 / (h + 10)).sum(),
}
CODECS = {"quantize 2-bit": dict(bits=2, adaptive=False), "division": dict(codec="division"),
          "lorenzo": dict(codec="lorenzo", error_bound=1e-2)}


def _gradient(loss_of, config: act.ACTConfig | None, x: torch.Tensor):
    x = x.detach().requires_grad_()
    compressor = None
    if config is None:
        loss = loss_of(x * 1)
    else:
        compressor = act.ActivationCompressor(None, config)
        with compressor.compress():
            loss = loss_of(x * 1)  # x * 1: an op output (x itself is a leaf, kept as a parameter would be)
    loss.backward()
    return x.grad, compressor


def _input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(512, 32) + torch.arange(512 * 32).view(512, 32) * 1e-6  # no ties


@pytest.mark.filterwarnings("ignore:index_reduce")  # "in beta"
@pytest.mark.parametrize("masks", [True, False], ids=["masks", "no masks"])
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("op", list(COMPARING))
def test_what_a_backward_compares_or_divides_by_is_kept_exact(op, codec, masks):
    x = _input()
    expected, _ = _gradient(COMPARING[op], None, x)
    got, compressor = _gradient(COMPARING[op], act.ACTConfig(min_numel=0, compress_masks=masks, **CODECS[codec]), x)
    assert got.isfinite().all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # exact floats (the scatters by amax and amin store none: their winner masks, tests/test_winner_masks.py)
    records = compressor.stats().records
    floats = [r for r in records if r.dtype.is_floating_point]
    assert records and all(r.codec == "none" for r in floats), [(r.codec, r.reason) for r in floats]


def _large_divisor_loss(h):
    return (h.detach() / (h.square() + 1e-3)).sum()


def _probabilities(h):
    return (h * 0.1 + 0.5).clamp(0.001, 0.999)  # (clamp saves its input, not these)


def _log_probabilities_loss(h):
    return torch.log(torch.softmax(h * 4, dim=1))[:, 0].sum()  # log of a softmax: many tiny probabilities


@pytest.mark.parametrize("rule_of, loss_of, codec", [
    (torch.amax, COMPARING["torch.amax"], dict(bits=2, adaptive=False)),
    (torch.Tensor.__truediv__, _large_divisor_loss, dict(codec="division")),
    (torch.log, _log_probabilities_loss, dict(codec="lorenzo", error_bound=1e-2)),
    (torch.hypot, lambda h: torch.hypot(h, _TARGET).sum(), dict(codec="division")),
], ids=["amax", "division by a small divisor", "log of probabilities under lorenzo", "hypot under division"])
def test_without_the_rule_the_gradient_is_lost(rule_of, loss_of, codec):
    """What the rules prevent: the same ops with the rule taken out give NaN or infinite gradients."""
    rule = op_rules.OP_RULES[rule_of]
    functions = [fn for fn, r in op_rules.OP_RULES.items() if r is rule]
    for fn in functions:
        del op_rules.OP_RULES[fn]
    try:
        got, _ = _gradient(loss_of, act.ACTConfig(min_numel=0, **codec), _input())
    finally:
        op_rules.OP_RULES.update(dict.fromkeys(functions, rule))
    assert not got.isfinite().all()


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("expand", [False, True], ids=["row sums", "expanded row sums"])
def test_a_statistic_divided_by_is_kept_exact(codec, expand):
    """``x / x.sum(1, keepdim=True)`` (expanded or broadcast): the sums are kept, what they divide takes the codec."""
    def loss_of(h):
        sums = (h + 10).sum(1, keepdim=True)
        return (h.square() / (sums.expand(-1, 32) if expand else sums)).sum()

    got, compressor = _gradient(loss_of, act.ACTConfig(min_numel=0, **CODECS[codec]), _input())
    assert got.isfinite().all()
    codecs = sorted((r.codec, tuple(r.shape)) for r in compressor.stats().records if r.dtype.is_floating_point)
    configured = CODECS[codec].get("codec", "quantize")
    assert ("none", (512, 1) if not expand else (512, 32)) in codecs
    assert all(name in ("none", configured) for name, _ in codecs) and (configured, (512, 32)) in codecs


# calls of the same functions whose backward needs no exact value: their float tensors take the configured codec
NOT_COMPARING = {
    "max(x, dim)": lambda h: torch.max(h.square(), 1).values.sum(),  # saves indices; square saves h
    "max(x, y)": lambda h: torch.max(h, h.flip(0)).sum(),  # a tie moves, no gradient is lost
    "scatter_reduce sum": lambda h: h.new_zeros(50, 32).scatter_reduce(0, _COLUMNS, h.square(), "sum").sum(),
    "norm p=2": lambda h: h.norm(p=2, dim=1).sum(),
    "h / 3": lambda h: (h.square() / 3).sum(),
}


@pytest.mark.parametrize("op", list(NOT_COMPARING))
def test_other_calls_of_those_functions_are_compressed(op):
    _, compressor = _gradient(NOT_COMPARING[op], act.ACTConfig(min_numel=0, bits=4, adaptive=False), _input())
    floats = [r for r in compressor.stats().records if r.dtype.is_floating_point]
    assert floats and all(r.kind == COMPRESSED and r.codec == "quantize" for r in floats), \
        [(r.codec, r.reason) for r in floats]


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("loss_of, op", [
    (_large_divisor_loss, "a divisor as large as its dividend"),
    (lambda h: torch.log(h + 10).sum(), "log's input"),
    (lambda h: ((h + 10) ** -0.5).sum(), "a power under 1's input"),
    # (clamp saves its input, not the probabilities; the constant target goes at 8 bits too)
    (lambda h: nn.functional.binary_cross_entropy((h * 0.05 + 0.5).clamp(0.01, 0.99), _TARGET), "BCE's input"),
    (lambda h: nn.functional.kl_div(_TARGET.log(), (h * 0.05 + 0.5).clamp(0.01, 0.99), reduction="sum"),
     "kl_div's target"),
    (lambda h: torch.hypot(h, _TARGET).sum(), "hypot's result"),
    (lambda h: torch.xlogy(_TARGET, _probabilities(h)).sum(), "xlogy's y"),
    (lambda h: torch.special.entr(_probabilities(h)).sum(), "entr's input"),
    (lambda h: torch.acosh(_probabilities(h) + 1).sum(), "acosh's input, near its domain's edge"),
    (lambda h: torch.logit(_probabilities(h)).sum(), "logit's input"),
    (lambda h: nn.functional.poisson_nll_loss(_probabilities(h), _TARGET * 3, log_input=False), "Poisson NLL's"),
    (lambda h: torch.pow(_probabilities(h), _TARGET).sum(), "a base under a tensor exponent"),
], ids=["divisor", "log", "power", "binary cross-entropy", "kl_div", "hypot", "xlogy", "entr", "acosh", "logit",
        "poisson_nll_loss", "tensor power"])
def test_what_a_backward_divides_by_goes_at_8_bits_in_range(loss_of, op, codec):
    """An elementwise divisor (a graph attention's per-edge softmax sums), a logarithm's or a root's input are not
    kept whole: 8 bits of quantize, whose grid stays within each group's range (division and lorenzo give way to
    it: their residuals, and lorenzo's zeros under its bound, turned small positive values into 0 or negatives)."""
    got, compressor = _gradient(loss_of, act.ACTConfig(min_numel=0, **CODECS[codec]), _input())
    assert got.isfinite().all(), op
    in_range = [r for r in compressor.stats().records if r.bits == op_rules.IN_RANGE_BITS]
    assert in_range and all(r.codec == "quantize" and r.kind == COMPRESSED for r in in_range)


def test_the_gradient_rules_are_tracked_without_masks():
    without = op_rules.tracked_functions(masks=False)
    assert torch.amax in without and torch.Tensor.scatter_reduce_ in without and torch.nn.functional.cross_entropy \
        in without
    assert torch.nn.functional.relu not in without and torch.nn.functional.linear not in without
    assert without < op_rules.tracked_functions()


def test_a_max_aggregating_gnn_trains_with_finite_gradients():
    """torch_geometric's SAGEConv with max aggregation (``scatter_reduce_(..., "amax")``) at the default level:
    the gradient of the compressed step stays close to the exact one (it was NaN)."""
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(0)
    edges = torch.randint(0, 500, (2, 4000))
    x, y = torch.randn(500, 16), torch.randint(0, 3, (500,))
    conv, head = pyg_nn.SAGEConv(16, 32, aggr="max"), nn.Linear(32, 3)
    model = nn.ModuleList([conv, head])

    def step(compressor=None):
        model.zero_grad()
        if compressor is None:
            loss = nn.functional.cross_entropy(head(conv(x, edges).relu()), y)
        else:
            with compressor.compress():
                loss = nn.functional.cross_entropy(head(conv(x, edges).relu()), y)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    expected = step()
    got = step(act.ActivationCompressor(model, act.ACTConfig()))
    assert got.isfinite().all()
    assert nn.functional.cosine_similarity(got, expected, dim=0) > 0.99


@pytest.mark.parametrize("codec, stored", [
    ("quantize 2-bit", [("quantize", 2.0), ("quantize", 0.0)]),
    ("lorenzo", [("lorenzo", None), ("quantize", 8.0)]),
    ("division", [("division", None), ("quantize", 8.0)]),
])
def test_a_storage_saved_again_by_a_log_is_stored_apart_only_out_of_range(codec, stored):
    """``log(exp(h))``: exp saves its result in the configured codec, then log saves the same storage under its
    in-range floor. A quantized form serves it (a duplicate: both backwards read one rounding), a lorenzo or
    division form does not (stored again, at 8 bits of quantize)."""
    got, compressor = _gradient(lambda h: torch.log(h.exp()).sum(), act.ACTConfig(min_numel=0, **CODECS[codec]),
                                _input())
    assert got.isfinite().all()
    records = compressor.stats().records
    assert [(r.codec, r.bits if expected is not None else None) for r, (_, expected) in zip(records, stored)] == \
        stored


CONV_OPS = {
    # a channel's maximum: compared (exact)
    "amax over channels": (lambda h: torch.amax(h, dim=1).sum(), "none"),
    # sqrt's result divides its gradient (exact; h + 10: positive, and an add saves nothing)
    "sqrt": (lambda h: torch.sqrt(h + 10).sum(), "none"),
    # a log of a positive map: in range, at 8 bits of quantize
    "log": (lambda h: torch.log(h + 10).sum(), "quantize"),
}


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last],
                         ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
@pytest.mark.parametrize("op", list(CONV_OPS))
def test_conv_activations_of_every_dtype_and_layout(op, dtype, memory_format):
    """A conv activation (4 x 8 x 12 x 12) in float64 or bfloat16, contiguous or channels_last, under division: what
    the op compares or divides by comes back exact (the same gradient as without compression) or in range."""
    loss_of, codec = CONV_OPS[op]
    torch.manual_seed(2)
    x = torch.randn(4, 8, 12, 12, dtype=dtype).to(memory_format=memory_format)
    expected, _ = _gradient(loss_of, None, x)
    got, compressor = _gradient(loss_of, act.ACTConfig(min_numel=0, codec="division"), x)
    assert got.dtype == dtype and got.isfinite().all()
    records = [r for r in compressor.stats().records if r.dtype == dtype and r.codec == codec]
    assert records, [(r.codec, r.dtype) for r in compressor.stats().records]
    if codec == "none":
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    else:
        assert all(r.bits == op_rules.IN_RANGE_BITS for r in records)
        torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)


NORMALIZATIONS = {
    # name -> (module over rows of 64 contiguous elements of an 8 x 17 x 64 input, its row length)
    "layer_norm": (lambda: nn.LayerNorm(64), 64),
    "rms_norm": (lambda: nn.RMSNorm(64), 64),
    "group_norm": (lambda: nn.GroupNorm(1, 17), 17 * 64),
    "instance_norm": (lambda: nn.InstanceNorm1d(17, affine=True), 64),
}
_NORM_CODECS = {"quantize 8-bit": dict(bits=8, adaptive=False), "quantize 4-bit": dict(bits=4, adaptive=False),
                "division": dict(codec="division"), "lorenzo": dict(codec="lorenzo", error_bound=1e-3)}


def _class_token_rows(dtype: torch.dtype) -> torch.Tensor:
    """A ViT's layer-norm input at initialisation: patch rows of unit scale and an all-zero class-token row (BEiT
    initialises it to zeros), 64 elements a row: a group of 256 holds four rows."""
    torch.manual_seed(2)
    x = torch.randn(8, 17, 64, dtype=dtype)
    x[:, 0] = 0
    return x


def _statistics_kept_exact(compressor, input_numel: int) -> bool:
    statistics = [r for r in compressor.stats().records if r.kind != "parameter" and r.shape.numel() < input_numel]
    return bool(statistics) and all(r.codec == "none" and r.kind in (COMPRESSED, DUPLICATE) for r in statistics)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                         ids=["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("codec", list(_NORM_CODECS))
@pytest.mark.parametrize("norm", list(NORMALIZATIONS))
def test_a_normalisation_keeps_its_statistics_exact_and_rounds_each_row_in_its_own_range(norm, codec, dtype):
    """A zero row's 1/std is 1/sqrt(eps): its statistics quantized with the other rows' (8 bits), or its input rounded
    in a group shared with patch rows, gave a gradient of cosine -0.1 against the exact one. The input goes on
    quantize's grid whatever the codec (division's and lorenzo's errors are not relative to a row)."""
    make, row = NORMALIZATIONS[norm]
    torch.manual_seed(0)
    module = make().to(dtype)
    x = _class_token_rows(dtype)
    weight = torch.randn(8, 17, 64, dtype=dtype, requires_grad=True)  # a leaf: kept, as a parameter is

    def loss_of(h):
        return (module(h) * weight).sum()

    expected, _ = _gradient(loss_of, None, x)
    got, compressor = _gradient(loss_of, act.ACTConfig(min_numel=0, **_NORM_CODECS[codec]), x)
    assert got.isfinite().all()
    assert nn.functional.cosine_similarity(got.double().flatten(), expected.double().flatten(), dim=0) > 0.95
    assert _statistics_kept_exact(compressor, x.numel())
    values = next(r for r in compressor.stats().records if r.shape.numel() == x.numel())  # the input, saved first
    groups = x.numel() // math.gcd(row, 256)
    assert (values.codec, values.stored_bytes) == \
        ("quantize", x.numel() * (8 if codec == "quantize 8-bit" else 4) // 8 + groups * 2 * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last],
                         ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("codec", list(_NORM_CODECS))
@pytest.mark.parametrize("norm", ["batch_norm", "group_norm"])
def test_a_conv_normalisation_keeps_its_statistics_exact(norm, codec, memory_format, dtype):
    """A batch norm's input keeps the configured codec and groups (its channels span the batch); a group norm's
    contiguous rows (a sample's channel group, 2 x 8 x 12 elements) take quantize's groups within them, and its
    channels_last input, whose rows are strided, the configured codec."""
    torch.manual_seed(0)
    module = (nn.BatchNorm2d(8) if norm == "batch_norm" else nn.GroupNorm(4, 8)).to(dtype)
    x = torch.randn(4, 8, 8, 12, dtype=dtype).to(memory_format=memory_format)
    weight = torch.randn(4, 8, 8, 12, dtype=dtype, requires_grad=True)  # a leaf: kept, as a parameter is

    def loss_of(h):
        return (module(h) * weight).sum()

    got, compressor = _gradient(loss_of, act.ACTConfig(min_numel=0, **_NORM_CODECS[codec]), x)
    expected, _ = _gradient(loss_of, None, x)
    assert got.isfinite().all() and _statistics_kept_exact(compressor, x.numel())
    assert nn.functional.cosine_similarity(got.double().flatten(), expected.double().flatten(), dim=0) > 0.9
    values = next(r for r in compressor.stats().records if r.shape == x.shape)
    if norm == "group_norm" and memory_format == torch.contiguous_format:
        bits = 8 if codec == "quantize 8-bit" else 4
        assert (values.codec, values.stored_bytes) == \
            ("quantize", x.numel() * bits // 8 + x.numel() // math.gcd(2 * 8 * 12, 256) * 8)
    else:
        assert values.codec == _NORM_CODECS[codec].get("codec", "quantize")


@pytest.mark.parametrize("hidden, group", [(384, 128), (768, 256), (96, 32), (80, 256)])
def test_a_layer_norm_input_is_grouped_within_its_rows(hidden, group):
    """Groups of the greatest common divisor of the row and the configured group size, where that is a group size
    (a multiple of 32; 80 elements a row keep the configured groups)."""
    norm = nn.LayerNorm(hidden)
    compressor = act.ActivationCompressor(norm, act.ACTConfig(bits=4, adaptive=False, min_numel=0))
    x = torch.randn(8, 16, hidden)
    with compressor.compress():
        y = norm(x * 1)
    y.sum().backward()
    (values,) = [r for r in compressor.stats().records if r.shape == x.shape]
    assert (values.codec, values.stored_bytes) == ("quantize", x.numel() // 2 + -(-x.numel() // group) * 8)


def test_a_layer_norm_input_first_saved_in_shared_groups_is_stored_again_within_rows():
    """``h * s`` saves h in the configured groups (four 64-element rows a group); the layer norm reading the same
    storage next stores it again, grouped by row, and its gradient keeps the zero row's."""
    torch.manual_seed(0)
    norm, scale = nn.LayerNorm(64), torch.randn(64, requires_grad=True)
    x = _class_token_rows(torch.float32)

    def loss_of(h):
        return (h * scale).sum() + (norm(h) * torch.linspace(-1, 1, 64)).sum()

    expected, _ = _gradient(loss_of, None, x)
    got, compressor = _gradient(loss_of, act.ACTConfig(bits=8, adaptive=False, min_numel=0), x)
    values = [r for r in compressor.stats().records if r.shape == x.shape]
    assert [(r.kind, r.stored_bytes) for r in values] == [(COMPRESSED, x.numel() + x.numel() // 256 * 8),
                                                         (COMPRESSED, x.numel() + x.numel() // 64 * 8)]
    assert nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.99
