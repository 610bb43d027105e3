"""The model families (issue 31): one module per family, one registry, one declaration of
the model keys.

- :mod:`parcompile.core.families`: every ``model_type`` has one family, declared in one
  module; the registry is what :mod:`parcompile.core.hf`, :mod:`parcompile.core.hf_weights`
  and the presets read (no second list of model types, architectures or presets).
- :class:`parcompile.core.model.ModelKeys` declares the model keys; ``ModelConfig``, the
  front end's key table and the verify miniature derive from it.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from parcompile.config.presets import MODEL_PRESETS
from parcompile.config.schema import ModelConfig
from parcompile.core import families, hf, hf_weights
from parcompile.core.model import MODEL_KEY_CHECKS, REQUIRED_MODEL_KEYS, ModelKeys
from parcompile.frontend.build import KEYS


def test_every_model_type_is_one_family_of_one_module():
    seen = [f.model_type for mod in families.MODULES for f in mod.FAMILIES]
    assert len(seen) == len(set(seen)), "a model_type declared twice"
    assert hf.SUPPORTED_MODEL_TYPES == hf_weights.FAMILIES == families.MODEL_TYPES == tuple(sorted(seen))
    assert hf_weights.ARCHITECTURES == {t: families.get(t).architecture for t in seen}
    for f in (families.get(t) for t in seen):
        assert f.features <= set(families.FEATURES), (f.model_type, f.features - set(families.FEATURES))
    assert families.get("bert") is None


def test_presets_come_from_the_family_modules():
    """Each preset is declared by the module of the family it is written as, once."""
    names = [n for mod in families.MODULES for n in mod.PRESETS]
    assert len(names) == len(set(names)) and list(MODEL_PRESETS) == names
    for mod in families.MODULES:
        types = {f.model_type for f in mod.FAMILIES}
        for name, keys in mod.PRESETS.items():
            model = ModelKeys(**keys)
            assert hf_weights.hf_family(model) in types, (mod.__name__, name)


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_for_model_guesses_the_family_that_expresses_the_preset(name):
    model = ModelKeys(**MODEL_PRESETS[name])
    family = families.for_model(model)
    assert hf_weights.family_problems(model, family.model_type) == []
    # and the config.json it writes imports back as the same keys
    cfg = hf_weights.hf_config(model, family.model_type)
    back = hf_weights.model_from_checkpoint_config(cfg, seq_len=model.seq_len, dtype=model.dtype,
                                                   name=model.name)
    differ = {k: (getattr(model, k), getattr(back, k)) for k in MODEL_KEY_CHECKS
              if getattr(model, k) != getattr(back, k)}
    assert not differ, differ


def test_a_family_owns_its_keys():
    """A key only some families have (FEATURES) is refused by the others, by name."""
    gemma = ModelKeys(**MODEL_PRESETS["gemma3-27b"])
    (p,) = hf_weights.family_problems(gemma, "llama")
    assert "zero_centered_gamma = true" in p.message and "sliding_window_pattern = 6" in p.message
    (p,) = hf_weights.family_problems(ModelKeys(**MODEL_PRESETS["llama3-8b"]), "gemma3_text")
    assert "zero_centered_gamma = False (Gemma 3 has true)" in p.message


# --------------------------------------------------------------------------- one declaration of the keys


def test_model_config_is_built_from_model_keys():
    """Same names in the same order (plan.json's), same defaults, same required keys, and an
    enum key's choices as the schema's Literal."""
    mk = dataclasses.fields(ModelKeys)
    assert list(ModelConfig.model_fields) == [f.name for f in mk]
    for f in mk:
        info = ModelConfig.model_fields[f.name]
        assert info.is_required() == (f.default is dataclasses.MISSING), f.name
        if not info.is_required():
            assert info.default == f.default, f.name
        check = f.metadata["check"]
        if check is not None and check.kind == "enum":
            assert typing.get_args(info.annotation) == check.choices, f.name
    assert REQUIRED_MODEL_KEYS == tuple(k for k, i in ModelConfig.model_fields.items() if i.is_required())


def test_front_end_key_table_is_the_declaration():
    """build.KEYS['model'] is every declared key but the block's name, with its check."""
    assert list(KEYS["model"]) == [f.name for f in dataclasses.fields(ModelKeys) if f.name != "name"]
    for name, t in KEYS["model"].items():
        check = MODEL_KEY_CHECKS[name]
        assert (t.kind, t.low, t.low_open, t.high, t.high_open, t.choices) == (
            check.kind, check.low, check.low_open, check.high, check.high_open, check.choices), name
    assert KEYS["model"]["norm"].choices == ("layernorm", "rmsnorm")


def test_miniature_keeps_every_key_it_does_not_set():
    """verify's miniature names the keys it sets; every other model key is the model's, so a
    new key reaches the miniature without a second list."""
    from parcompile.verification import MINIATURE_KEYS

    assert MINIATURE_KEYS <= set(MODEL_KEY_CHECKS)
    kept = set(MODEL_KEY_CHECKS) - MINIATURE_KEYS
    assert {"norm", "activation", "qk_norm", "zero_centered_gamma", "rope_type", "attention_sinks"} <= kept


def test_a_new_family_brings_its_own_keys():
    """A family's ``owns`` joins the feature table: the other families refuse a model with
    those keys, the owner does not (how Gemma 2's soft-capping keys would be checked)."""
    from parcompile.core.families.base import Family, foreign_problems

    own = {"dropping": (lambda m, f: [f"dropout = {m.dropout}"] if m.dropout else [], False)}
    owner = dataclasses.replace(families.get("llama"), model_type="dropper", owns=own)
    table = {**families.FEATURES, **own}
    m = ModelKeys(**{**MODEL_PRESETS["llama3-8b"], "dropout": 0.1})
    assert foreign_problems(m, families.get("llama"), table) == ["dropout = 0.1"]
    assert foreign_problems(m, owner, table) == []
    assert isinstance(owner, Family)
