import re

import numpy as np
import pytest

import lightning_act as act
from lightning_act.config import resolve_config


def test_defaults_follow_level_l1():
    cfg = act.ACTConfig()
    assert (cfg.opt_level, cfg.codec, cfg.bits, cfg.group_size) == ("L1", "quantize", 4, 256)
    assert cfg.enabled


def test_l0_means_no_compression():
    cfg = act.ACTConfig(opt_level="L0")
    assert (cfg.codec, cfg.bits, cfg.enabled) == ("none", 32, False)


@pytest.mark.parametrize("field, value, match", [
    ("bits", 3, r"bits=3; expected one of 1, 2, 4, 8, 16, 32"),
    ("bits", True, r"bits=True; expected one of"),
    ("bits", 4.0, r"bits=4.0; expected one of 1, 2, 4, 8, 16, 32"),  # equal to 4, but a float reaches the sizes
    ("blpa_bits", 8.0, r"blpa_bits=8.0; expected one of None, 4, 8"),
    ("opt_level", "L9", r"opt_level='L9'; expected one of 'L0', 'L1', 'L2', 'CB1', 'CB2'"),
    ("codec", "zip", r"codec='zip'; expected one of .*'quantize'"),
    ("group_size", 100, r"group_size=100; expected an integer >= 32 and a multiple of 32"),
    ("group_size", 0, r"group_size=0"),
    ("stats_dtype", "float16", r"stats_dtype='float16'; expected one of 'float32', 'bfloat16'"),
    ("backend", "triton", r"backend='triton'; expected one of 'auto', 'torch', 'cupy'"),
    ("min_numel", -1, r"min_numel=-1; expected an integer >= 0"),
    ("seed", -5, r"seed=-5"),
    ("blpa_bits", 2, r"blpa_bits=2; expected one of None, 4, 8"),
    ("bounded_cnn", "yes", r"bounded_cnn='yes'; expected one of True, False"),
    ("bounded_ffn", "yes", r"bounded_ffn='yes'; expected one of True, False"),
    ("error_bound", 0.0, r"error_bound=0.0; expected a finite number > 0"),
    ("error_bound", float("nan"), r"error_bound=nan"),
])
def test_invalid_values_name_field_value_and_allowed(field, value, match):
    with pytest.raises(ValueError, match=match):
        act.ACTConfig(**{field: value})


@pytest.mark.parametrize("level, swap, checkpointing, attention", [
    ("L1", False, False, False), ("L2", True, False, False), ("CB1", False, True, False), ("CB2", False, True, True),
])
def test_levels_follow_gact_table_1(level, swap, checkpointing, attention):
    cfg = act.ACTConfig(opt_level=level)
    assert (cfg.codec, cfg.bits) == ("quantize", 4)
    assert (cfg.swap, cfg.checkpointing, cfg.efficient_attention) == (swap, checkpointing, attention)


def test_explicit_fields_override_the_level_and_are_validated():
    assert act.ACTConfig(opt_level="L2", bits=2).bits == 2
    assert act.ACTConfig(opt_level="L0", swap=True).swap  # GACT's uncompressed swap baseline
    with pytest.raises(ValueError, match=r"swap='yes'; expected one of True, False"):
        act.ACTConfig(swap="yes")


def test_l0_rejects_a_codec():
    with pytest.raises(ValueError, match=r"opt_level='L0' means no compression; got codec='quantize'"):
        act.ACTConfig(opt_level="L0", codec="quantize")


def test_frozen_and_replace_validates():
    cfg = act.ACTConfig()
    with pytest.raises(AttributeError):
        cfg.bits = 2
    assert cfg.replace(bits=2).bits == 2
    with pytest.raises(ValueError, match="bits=5"):
        cfg.replace(bits=5)


def test_resolve_aliases():
    assert resolve_config("l0") == act.ACTConfig(opt_level="L0")
    assert resolve_config({"bits": 8}).bits == 8
    assert resolve_config(None) == act.ACTConfig()
    with pytest.raises(ValueError, match="opt_level='FAST'"):
        resolve_config("fast")
    with pytest.raises(TypeError, match="config=3"):
        resolve_config(3)
    with pytest.raises(ValueError, match=r"config has 'bitz', 'levle', which ACTConfig does not take; expected some "
                                         r"of opt_level, codec, bits, .*memory_budget"):
        resolve_config({"bits": 4, "bitz": 4, "levle": "L2"})


@pytest.mark.parametrize("options", [dict(codec="quantize"), dict(codec="division"), dict(opt_level="L0")])
def test_an_error_bound_for_a_codec_that_takes_none_is_refused(options):
    """error_bound bounds lorenzo's error; beside another codec it would bound nothing, silently."""
    with pytest.raises(ValueError, match=r"error_bound=0.001 is the bound of an error-bounded codec \('lorenzo'\); "
                                         r"got codec='(quantize|division|none)', which takes none"):
        act.ACTConfig(error_bound=1e-3, **options)
    assert act.ACTConfig(codec="lorenzo", error_bound=1e-3).codec_kwargs()["error_bound"] == 1e-3


@pytest.mark.parametrize("codec", ["positive_mask", "scaled_mask", "bitmask", "maxpool_index"])
def test_the_config_codec_is_one_that_stores_any_activation(codec):
    """The 1-bit masks and max-pool indices hold what one op saves (the op rules choose them): as the codec of every
    activation, positive_mask stored signs for values (a gradient at cosine 0.25) and scaled_mask failed inside
    the hook."""
    assert act.codecs.general() == ("division", "lorenzo", "none", "quantize")
    with pytest.raises(ValueError, match=rf"codec='{codec}'; expected one of 'division', 'lorenzo', 'none', "
                                         r"'quantize'"):
        act.ACTConfig(codec=codec)
    assert codec in act.codecs.available()  # still usable on its own and by the op rules


def test_codec_registry_lists_names_on_unknown():
    with pytest.raises(KeyError, match=r"unknown codec 'zstd'; available: .*bitmask.*none.*quantize"):
        act.codecs.get("zstd")


@pytest.mark.parametrize("name, options", [
    ("quantize", {}), ("division", {}), ("lorenzo", {"error_bound": 1e-2}), ("bitmask", {}), ("positive_mask", {}),
    ("scaled_mask", {}), ("none", {}), ("maxpool_index", {"kernel_size": 2, "input_size": (4, 4)})])
@pytest.mark.parametrize("given", [[1.0, 2.0], np.ones(3, dtype=np.float32), None], ids=["list", "ndarray", "None"])
def test_every_codec_on_its_own_refuses_what_is_not_a_tensor(name, options, given):
    """A codec used on its own says what it takes, not an AttributeError from inside its encode."""
    with pytest.raises(ValueError, match=rf"{name} codec encodes a torch.Tensor; got {type(given).__name__}"):
        act.codecs.get(name, **options).encode(given)


def test_codec_options_reach_the_codec_and_fields_stay_with_the_config():
    cfg = act.ACTConfig(codec="division", codec_options={"block_size": 4, "bits": 4}, seed=3)
    assert cfg.codec_kwargs() == {"seed": 3, "backend": "auto", "block_size": 4, "bits": 4}
    codec = act.ActivationCompressor(None, cfg).codec("division")
    assert (codec.block_size, codec.bits, codec.seed) == (4, 4, 3)
    # division keeps DIVISION's Q=2 residual unless told: the config's bits are quantize's
    assert act.ACTConfig(codec="division", bits=8).codec_kwargs() == {"seed": 0, "backend": "auto"}
    assert act.ACTConfig(codec="lorenzo", error_bound=1e-3).codec_kwargs() == {"error_bound": 1e-3, "backend": "auto"}
    given = {"block_size": 4}
    cfg = act.ACTConfig(codec="division", codec_options=given)
    given["block_size"] = 16
    assert cfg.codec_options == {"block_size": 4} and hash(cfg) == hash(act.ACTConfig(codec="division"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(codec="division", codec_options={"blocksize": 4}),
     r"codec_options has 'blocksize', which codec 'division' does not take; expected some of 'block_size', 'bits' "
     r"\(the others are ACTConfig fields: seed, backend\)"),
    (dict(codec="quantize", codec_options={"bits": 2}),
     r"codec_options has 'bits', which codec 'quantize' does not take; expected no codec_options \(the others are "
     r"ACTConfig fields: bits, group_size, stats_dtype, seed, backend\)"),
    (dict(codec="division", codec_options={"block_size": 0}), r"block_size=0; expected an integer >= 1"),
    (dict(codec="division", codec_options=[("bits", 4)]), r"codec_options=\[\('bits', 4\)\]; expected a dict"),
    (dict(codec="lorenzo"), r"error_bound=None; expected a finite number > 0"),
])
def test_codec_options_are_checked_when_the_config_is_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        act.ACTConfig(**kwargs)


def _entry_points():
    """(label, call) for each public entry point given an argument of the wrong type."""
    from torch import nn

    from lightning_act.adapt import AutoPrecision, ErrorBoundController
    from lightning_act.integrations import LayerStats, compress_forward, fuse_gcn, unfuse_gcn, unpatch

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    compressor = act.ActivationCompressor(model, act.ACTConfig())
    return [
        ("model='net'; expected an nn.Module or None", lambda: act.ActivationCompressor("net")),
        ("compressor='c'; expected an ActivationCompressor", lambda: AutoPrecision("c")),
        ("compressor='c'; expected an ActivationCompressor", lambda: ErrorBoundController("c")),
        ("optimizer='adam'; expected a torch.optim.Optimizer, a list of them or None",
         lambda: ErrorBoundController(compressor, "adam")),
        ("model=Linear (the class, not an instance of it); expected an nn.Module",
         lambda: LayerStats(nn.Linear, compressor)),
        ("compressor=dict; expected an ActivationCompressor", lambda: LayerStats(model, {})),
        ("model='net'; expected an nn.Module", lambda: compress_forward("net")),
        ("model='net'; expected an nn.Module", lambda: unpatch("net")),
        ("model='net'; expected an nn.Module", lambda: fuse_gcn("net")),
        ("model='net'; expected an nn.Module", lambda: unfuse_gcn("net")),
        ("model='net'; expected an nn.Module", lambda: act.nn.convert_bn_relu("net")),
        ("model='net'; expected an nn.Module", lambda: act.nn.convert_bounded_cnn("net")),
        ("model='net'; expected an nn.Module", lambda: act.nn.convert_bounded_ffn("net")),
        ("model='net'; expected an nn.Module", lambda: act.nn.wrap_conv_trunks("net")),
    ]


def test_public_entry_points_name_an_argument_of_the_wrong_type():
    """A TypeError naming the argument, what was given and what is expected, where an AttributeError from deep
    inside said neither."""
    for message, call in _entry_points():
        with pytest.raises(TypeError, match=re.escape(message)):
            call()


@pytest.mark.parametrize("build", [
    lambda: act.callbacks.ErrorBoundCallback(interval=0),
    lambda: __import__("lightning_act.integrations.transformers", fromlist=["ACTTrainer"])._error_bound_options(
        {"interval": 0}),
], ids=["lightning callback", "transformers act_error_bound"])
def test_error_bound_options_are_checked_when_given_not_when_training_starts(build):
    """A bad option fails where it is written, not minutes later when the first optimizer step builds the
    controller."""
    with pytest.raises(ValueError, match=r"interval=0; expected an integer >= 1"):
        build()
