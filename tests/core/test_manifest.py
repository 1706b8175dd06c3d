"""The manifest gate's value: built from a state dict or a module, a stable digest, JSON round trips, and a check
that lists every missing, extra and mismatched name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from reshard import Manifest, ManifestError


class _Fake:
    """A tensor as the manifest sees one: anything with .shape and .dtype (torch's and JAX's included)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


class _Module:
    def __init__(self, sd):
        self._sd = sd

    def state_dict(self):
        return self._sd


SD = {"layers.0.w": np.zeros((4, 3), np.float32), "embed": np.zeros((13, 4), np.float32),
      "layers.1.w": _Fake((4, 3), "torch.bfloat16"), "norm": np.zeros((4,), np.int64)}


def test_built_from_a_state_dict_or_module_sorted_and_named_as_reshard_names_dtypes():
    m = Manifest.from_state_dict(SD)
    assert m.names == ("embed", "layers.0.w", "layers.1.w", "norm")
    assert m.tensors["layers.1.w"] == ((4, 3), "bfloat16")
    assert Manifest.from_module(_Module(SD)) == m
    assert len(m) == 4 and "norm" in m and "missing" not in m
    assert m.nbytes == 13 * 4 * 4 + 12 * 4 + 12 * 2 + 4 * 8
    assert str(m) == f"Manifest(4 tensors, 312 B, sha256 {m.digest[:12]})"
    assert repr(m).startswith("Manifest({'embed': float32[13, 4], 'layers.0.w': float32[4, 3], 'layers.1.w': ")


def test_digest_is_stable_over_order_and_json_round_trips():
    m = Manifest.from_state_dict(SD)
    backwards = Manifest.from_state_dict(dict(reversed(list(SD.items()))))
    assert backwards.digest == m.digest and backwards == m and hash(backwards) == hash(m)
    # The digest is SHA-256 of the canonical text, so any machine computes the same one.
    assert m.json_text() == ('{"format":1,"tensors":[{"dtype":"float32","name":"embed","shape":[13,4]},'
                             '{"dtype":"float32","name":"layers.0.w","shape":[4,3]},'
                             '{"dtype":"bfloat16","name":"layers.1.w","shape":[4,3]},'
                             '{"dtype":"int64","name":"norm","shape":[4]}]}')
    assert m.digest == "%s" % __import__("hashlib").sha256(m.json_text().encode()).hexdigest()
    assert Manifest.from_json(m.json_text()) == m == Manifest.from_json(json.loads(m.json_text()))
    other = Manifest({**m.tensors, "norm": ((5,), "int64")})
    assert other.digest != m.digest


def test_frozen():
    m = Manifest.from_state_dict(SD)
    with pytest.raises(TypeError, match="a Manifest is immutable"):
        m.tensors["x"] = ((1,), "float32")
    source = {"a": ((1,), "float32")}
    kept = Manifest(source)
    source["b"] = ((2,), "float32")
    assert kept.names == ("a",)


def test_check_lists_each_missing_extra_and_mismatched_name():
    m = Manifest.from_state_dict(SD)
    offered = {"embed": ((13, 4), "float32"), "layers.0.w": ((4, 3), "float16"),
               "layers.0.w/rank1": ((1, 3), "float32"), "norm": ((4,), "int64")}
    with pytest.raises(ManifestError) as e:
        m.check(offered, "reshard_many of 4 tensors", absent=[("layers.1.w", "not in the catalog")])
    assert str(e.value) == (
        f"reshard_many of 4 tensors does not match the consumer's manifest (4 tensors, sha256 {m.digest[:12]}): "
        "1 missing: 'layers.1.w' (not in the catalog); 1 extra: 'layers.0.w/rank1'; 1 mismatched: 'layers.0.w' is "
        "float16[4, 3] where the manifest has float32[4, 3]. Nothing moved. Publish every tensor the manifest lists "
        "under its global name, shape and dtype (a state dict's own names, not per-rank ones), or build the manifest "
        "from the module that will load the weights (Manifest.from_module)")
    assert isinstance(e.value, ValueError)
    m.check({n: (tuple(t.shape), t.dtype) for n, t in SD.items()}, "a put")  # equal: passes


def test_long_lists_are_cut_with_a_count():
    m = Manifest({f"layers.{i}.w": ((2,), "float32") for i in range(20)})
    text = str(m.diff({}))
    assert text.startswith("20 missing: 'layers.0.w', 'layers.1.w', ") and text.endswith(", ... and 12 more")


@pytest.mark.parametrize("bad, message", [
    ({"w": ((-1,), "float32")}, "manifest shape of 'w' must be a tuple of sizes >= 0; got \\(-1,\\)"),
    ({"w": ((2,), "float99")}, "manifest dtype of 'w': unknown dtype 'float99'"),
    ({"": ((2,), "float32")}, "manifest names are non-empty strings; got ''"),
    ({"w": (2,)}, r"manifest entry of 'w' must be \(shape, dtype\); got \(2,\)"),
])
def test_bad_entries_are_refused(bad, message):
    with pytest.raises(ManifestError, match=message):
        Manifest(bad)


def test_bad_json_is_refused_naming_the_field():
    with pytest.raises(ManifestError, match="manifest format 2 is not one this version reads"):
        Manifest.from_json('{"format": 2, "tensors": []}')
    with pytest.raises(ManifestError, match="manifest names 'a' twice"):
        Manifest.from_json('{"format": 1, "tensors": [{"name": "a", "shape": [], "dtype": "int8"},'
                           '{"name": "a", "shape": [], "dtype": "int8"}]}')
    with pytest.raises(ValueError, match="manifest_json is not JSON"):
        Manifest.from_json("{")
    with pytest.raises(ManifestError, match="Manifest.from_state_dict takes a mapping"):
        Manifest.from_state_dict([1])
    with pytest.raises(ManifestError, match="state dict entry 'step' is a int"):
        Manifest.from_state_dict({"step": 3})


def test_with_prefix_names_the_published_tensors():
    m = Manifest({"w": ((2,), "float32")})
    assert m.with_prefix("policy/").tensors == {"policy/w": ((2,), "float32")}
    assert m.with_prefix("policy/").digest != m.digest
