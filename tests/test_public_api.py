"""A snapshot of the public names: adding or removing one is a deliberate act."""

import mixprec


EXPECTED = {
    # core
    "Policy",
    "get_policy",
    "get_global_policy",
    "set_global_policy",
    "policy_scope",
    "cast_tree",
    "is_floating_array",
    "half_dtype",
    "cast_to_half",
    "cast_to_full",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "all_finite",
    "select_tree",
    # autocast
    "autocast",
    "register_rule",
    "float32_scope",
    "precision_scope",
    # training
    # numerics
}


def test_public_names():
    public = {n for n in dir(mixprec) if not n.startswith("_")}
    assert public == EXPECTED


def test_every_public_name_has_a_docstring_with_an_example():
    for name in EXPECTED:
        doc = getattr(mixprec, name).__doc__ or ""
        assert ">>>" in doc, f"mixprec.{name} has no runnable example"
