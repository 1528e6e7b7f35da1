"""The engine's one way to set per-tensor policies: ``install_policy`` returns a handle whose ``remove()`` restores
what was there before; the slots themselves are read-only."""
import pytest
import torch
from torch import nn

import lightning_act as act


def _bits(n):
    return lambda index, t: n


@pytest.fixture
def compressor():
    return act.ActivationCompressor(nn.Linear(8, 8), act.ACTConfig(bits=4, min_numel=0))


def _slots(compressor):
    return compressor.bits_policy, compressor.codec_policy, compressor.noise_policy


def test_install_sets_only_the_given_slots_and_remove_restores_the_defaults(compressor):
    assert _slots(compressor) == (None, None, None)
    bits, noise = _bits(2), lambda step, index: index
    handle = compressor.install_policy(bits=bits, noise=noise)
    assert _slots(compressor) == (bits, None, noise)
    handle.remove()
    assert _slots(compressor) == (None, None, None)
    handle.remove()  # twice: nothing happens
    assert _slots(compressor) == (None, None, None)


def test_the_installed_policy_is_what_the_engine_uses(compressor):
    x = torch.randn(64, 8)

    def bits_of_step():
        with compressor.compress():
            compressor.model(x).sum().backward()
        return [r.bits for r in compressor.stats().records if r.kind == "compressed"]

    with compressor.install_policy(bits=_bits(2)):
        two = bits_of_step()
    four = bits_of_step()
    assert len(two) == len(four) == 1 and 2 <= two[0] < 3 and 4 <= four[0] < 5


def test_nested_installs_shadow_slot_by_slot_and_unwind_in_order(compressor):
    outer_bits, inner_bits, outer_codec = _bits(8), _bits(2), lambda index, t: None
    with compressor.install_policy(bits=outer_bits, codec=outer_codec):
        with compressor.install_policy(bits=inner_bits) as inner:
            assert _slots(compressor) == (inner_bits, outer_codec, None)
        assert inner.removed and _slots(compressor) == (outer_bits, outer_codec, None)
        with compressor.install_policy(bits=None):  # None installs the default over the outer policy
            assert compressor.bits_policy is None
        assert compressor.bits_policy is outer_bits
    assert _slots(compressor) == (None, None, None)


def test_removing_an_outer_handle_first_keeps_the_inner_policy(compressor):
    outer_bits, inner_bits = _bits(8), _bits(2)
    outer = compressor.install_policy(bits=outer_bits)
    inner = compressor.install_policy(bits=inner_bits)
    outer.remove()
    assert compressor.bits_policy is inner_bits
    inner.remove()
    assert compressor.bits_policy is None  # the removed outer policy does not come back


def test_policy_slots_cannot_be_assigned(compressor):
    for slot in ("bits", "codec", "noise"):
        with pytest.raises(AttributeError, match=f"{slot}_policy is read-only: use handle = "
                                                 rf"compressor.install_policy\({slot}=...\)"):
            setattr(compressor, f"{slot}_policy", None)


def test_unknown_slot_is_rejected(compressor):
    with pytest.raises(TypeError, match="unknown slot\\(s\\) bit; expected some of bits, codec, noise"):
        compressor.install_policy(bit=_bits(2))
    assert _slots(compressor) == (None, None, None)


@pytest.mark.parametrize("slot", ["bits", "codec", "noise"])
def test_a_policy_that_is_not_callable_is_rejected_when_installed(compressor, slot):
    """bits=4 for bits=lambda index, t: 4 would fail at the first saved tensor, inside autograd's hook."""
    with pytest.raises(TypeError, match=rf"install_policy\({slot}=4\); expected a callable or None"):
        compressor.install_policy(**{slot: 4})
    assert _slots(compressor) == (None, None, None)


def test_detached_steps_put_the_policies_back(compressor):
    before = _bits(8)
    outer = compressor.install_policy(bits=before)
    with compressor.detached_steps():
        left = compressor.install_policy(noise=lambda step, index: index)  # installed inside and not removed
        outer.remove()  # removed inside: stays removed
    assert _slots(compressor) == (None, None, None) and left.removed
    left.remove()  # harmless

    kept = compressor.install_policy(bits=before)
    with pytest.raises(RuntimeError, match="inside"):
        with compressor.detached_steps():
            compressor.install_policy(bits=_bits(2))
            raise RuntimeError("inside")
    assert compressor.bits_policy is before
    kept.remove()
