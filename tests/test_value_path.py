"""Every invalid value-path combination raises, naming the keys."""

import itertools

import pytest

from bov_jax.model.values import (
    BANK_INITS,
    COMBINES,
    LAYER_RULES,
    SCALES,
    SOURCES,
    ValuePathError,
    ValuePathSpec,
)


def _is_valid(source, combine, scale, shared, init):
    if source == "residual" and combine != "replace":
        return False
    if combine == "gated_add" and (source != "bank" or scale != "none"):
        return False
    return source == "bank" or (not shared and init == "aligned")


@pytest.mark.parametrize(
    "source,combine,scale,shared,init",
    list(itertools.product(SOURCES, COMBINES, SCALES, (False, True), BANK_INITS)),
)
def test_each_combination_is_accepted_or_rejected_by_the_rule(source, combine, scale, shared, init):
    spec = ValuePathSpec(
        source=source, combine=combine, scale=scale, bank_shared=shared, bank_init=init
    )
    if _is_valid(source, combine, scale, shared, init):
        spec.validate()
        for rule in LAYER_RULES:
            ValuePathSpec(source, combine, scale, rule, shared, init).target_layers(12)
    else:
        with pytest.raises(ValuePathError, match="model.value_path"):
            spec.validate()


@pytest.mark.parametrize("field", ["source", "combine", "scale", "layers", "bank_init"])
def test_unknown_choice_names_the_key(field):
    with pytest.raises(ValuePathError, match=f"model.value_path.{field}="):
        ValuePathSpec(**{field: "nonsense"}).validate()


def test_unknown_key_is_named():
    import ml_collections

    cfg = ml_collections.ConfigDict(dict(source="bank", sauce="x"))
    with pytest.raises(ValuePathError, match="model.value_path.sauce"):
        ValuePathSpec.from_config(cfg)


def test_v1_never_targets_layer_zero_and_bank_can():
    assert 0 not in ValuePathSpec(source="v1", layers="all").target_layers(12)
    assert 0 in ValuePathSpec(source="bank", layers="all").target_layers(12)
    assert ValuePathSpec(source="v1", layers="every_other").target_layers(12) == (1, 3, 5, 7, 9, 11)
