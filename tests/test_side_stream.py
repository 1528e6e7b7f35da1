"""Side-stream encodes (issue #20 item 4): the stream ordering, checked on CPU through stream operations that log
what they would do on CUDA, and results bit-identical to encoding on the compute stream."""
import threading

import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.codecs.base import Codec
from lightning_act.side_stream import SideStreamEncoder


class LoggedStreams:
    """Stream operations on CPU tensors that log each call; streams are names, "main" unless one is in use."""

    def __init__(self):
        self.log: list[tuple] = []
        self._local = threading.local()

    def takes(self, t):
        return t.device.type == "cpu"

    def current(self, device):
        return getattr(self._local, "stream", "main")

    def new_stream(self, device):
        self.log.append(("new_stream",))
        return "side"

    def use(self, stream):
        ops = self

        class _Use:
            def __enter__(self):
                self.previous = ops.current(None)
                ops._local.stream = stream
                ops.log.append(("enter", stream))

            def __exit__(self, *exc):
                ops._local.stream = self.previous
                ops.log.append(("exit", stream))

        return _Use()

    def wait(self, waiter, producer):
        self.log.append(("wait", waiter, producer))

    def used_by(self, tensor, stream):
        self.log.append(("used_by", tensor.untyped_storage().data_ptr(), stream))


@pytest.fixture
def logged(monkeypatch):
    streams = LoggedStreams()
    for cls in Codec.__subclasses__():
        orig_encode, orig_decode = cls.encode, cls.decode

        def encode(self, x, *, key=0, _orig=orig_encode):
            streams.log.append(("encode", self.name, streams.current(None)))
            return _orig(self, x, key=key)

        def decode(self, packed, _orig=orig_decode):
            streams.log.append(("decode", self.name, streams.current(None)))
            return _orig(self, packed)

        monkeypatch.setattr(cls, "encode", encode)
        monkeypatch.setattr(cls, "decode", decode)
    return streams


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))


def _grads(model, compressor, x):
    model.zero_grad(set_to_none=True)
    with compressor.compress():
        loss = model(x).square().sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_side_stream_config_is_validated():
    with pytest.raises(ValueError, match=r"side_stream='yes'; expected one of True, False"):
        act.ACTConfig(side_stream="yes")
    with pytest.raises(ValueError, match=r"side_stream=True .* swap=True: choose one"):
        act.ACTConfig(opt_level="L2", side_stream=True)
    assert act.ActivationCompressor(_mlp(), act.ACTConfig(bits=4)).side_stream is None


@pytest.mark.parametrize("codec", ["quantize", "division"])
def test_encodes_run_on_the_side_stream_in_order_and_gradients_are_unchanged(logged, codec):
    model, x = _mlp(), torch.randn(64, 64)
    config = act.ACTConfig(codec=codec, adaptive=False, min_numel=1)
    reference = _grads(model, act.ActivationCompressor(model, config), x)
    compressor = act.ActivationCompressor(model, config.replace(side_stream=True))
    compressor.side_stream = SideStreamEncoder(logged)
    logged.log.clear()
    grads = _grads(model, compressor, x)
    for a, b in zip(grads, reference):
        assert torch.equal(a, b)

    log = logged.log
    encodes = [i for i, e in enumerate(log) if e[0] == "encode"]
    decodes = [i for i, e in enumerate(log) if e[0] == "decode"]
    assert encodes and decodes
    assert log.count(("new_stream",)) == 1  # one side stream per device, built once
    for i in encodes:
        # the side stream waits for the compute stream, then the encode runs with the side stream current,
        # then the saved tensor is marked used by the side stream
        assert log[i - 2: i] == [("wait", "side", "main"), ("enter", "side")]
        assert log[i][2] == "side" and log[i + 1] == ("exit", "side")
        assert log[i + 2][0] == "used_by" and log[i + 2][2] == "side"
    # backward: the decoding stream waits for the side stream once, before the first decode
    waits_for_side = [i for i, e in enumerate(log) if e == ("wait", "main", "side")]
    assert waits_for_side == [decodes[0] - 1]
    for i in decodes:
        assert log[i][2] == "main"
        assert log[i + 1][0] == "used_by" and log[i + 1][2] == "main"  # the buffers, before the allocator reuses them


def test_a_new_encode_after_decodes_makes_the_next_decode_wait_again(logged):
    codec = act.codecs.get("quantize", bits=4)
    encoder = SideStreamEncoder(logged)
    x = torch.randn(1000)
    first, ticket1 = encoder.encode(codec, x, key=1)
    encoder.decode(codec, first, ticket1)
    encoder.decode(codec, first, ticket1)
    assert logged.log.count(("wait", "main", "side")) == 1
    second, ticket2 = encoder.encode(codec, x, key=2)
    assert ticket2 > ticket1
    assert torch.equal(encoder.decode(codec, second, ticket2), codec.decode(codec.encode(x, key=2)))
    assert logged.log.count(("wait", "main", "side")) == 2


def test_each_decoding_stream_waits_for_the_side_stream(logged):
    """A backward op runs on its forward op's stream: a wait of one stream does not order another one's decodes."""
    codec = act.codecs.get("quantize", bits=4)
    encoder = SideStreamEncoder(logged)
    x = torch.randn(1000)
    packed, ticket = encoder.encode(codec, x, key=1)
    encoder.decode(codec, packed, ticket)
    with logged.use("other"):
        encoder.decode(codec, packed, ticket)
        encoder.decode(codec, packed, ticket)
    encoder.decode(codec, packed, ticket)
    waits = [entry for entry in logged.log if entry[0] == "wait" and entry[2] == "side"]
    assert waits == [("wait", "main", "side"), ("wait", "other", "side")]


def test_lorenzo_and_kept_tensors_stay_on_the_compute_stream(logged):
    model, x = _mlp(), torch.randn(64, 64)
    compressor = act.ActivationCompressor(model, act.ACTConfig(codec="lorenzo", error_bound=1e-2, min_numel=1,
                                                               side_stream=True))
    compressor.side_stream = SideStreamEncoder(logged)
    _grads(model, compressor, x)
    lorenzo = [e for e in logged.log if e[0] == "encode" and e[1] == "lorenzo"]
    assert lorenzo and all(e[2] == "main" for e in lorenzo)
    side_encodes = [e for e in logged.log if e[0] == "encode" and e[2] == "side"]
    assert all(e[1] != "lorenzo" for e in side_encodes)


def test_without_its_device_nothing_goes_to_a_side_stream():
    """The default (CUDA) stream operations take no CPU tensor: side_stream=True changes nothing on CPU."""
    model, x = _mlp(), torch.randn(32, 64)
    config = act.ACTConfig(bits=4, adaptive=False, min_numel=1)
    compressor = act.ActivationCompressor(model, config.replace(side_stream=True))
    assert not compressor.side_stream.takes(x)
    assert all(torch.equal(a, b) for a, b in
               zip(_grads(model, compressor, x), _grads(model, act.ActivationCompressor(model, config), x)))
