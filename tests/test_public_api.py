"""A snapshot of the public names: adding or removing one is a deliberate act."""

from types import ModuleType

import mixprec


EXPECTED = {
    # core
    "Policy",
    "dtype_to_names",
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
    "modify_mixlist",
    "OpLists",
    "default_op_lists",
    "Float8Recipe",
    # training
    "value_and_grad",
    "grad",
    # numerics
    "explain",
    "diagnose",
    "PrecisionReport",
    "DiagnosisReport",
    "plan",
    "Plan",
}


def test_public_names():
    # Submodules (mixprec.optax, ...) appear in dir() once imported: not names.
    public = {
        n
        for n in dir(mixprec)
        if not n.startswith("_") and not isinstance(getattr(mixprec, n), ModuleType)
    }
    assert public == EXPECTED


def test_every_public_name_has_a_docstring_with_an_example():
    for name in EXPECTED:
        doc = getattr(mixprec, name).__doc__ or ""
        assert ">>>" in doc, f"mixprec.{name} has no runnable example"


def test_api_docs_are_current():
    import pathlib
    import runpy

    root = pathlib.Path(__file__).resolve().parent.parent
    gen = runpy.run_path(str(root / "tools" / "gen_api_docs.py"))
    assert (root / "docs" / "api.md").read_text() == gen["render"](), (
        "docs/api.md is stale: run `python tools/gen_api_docs.py`"
    )


def test_optax_compact_state_names_are_public_and_have_examples():
    import mixprec.optax

    compact = {
        "CompactState",
        "CompactStateReport",
        "compact_params",
        "compact_state",
        "decode_compact_state",
        "describe_compact_state",
        "master_params",
    }
    assert compact <= set(mixprec.optax.__all__)
    for name in mixprec.optax.__all__:
        doc = getattr(mixprec.optax, name).__doc__ or ""
        assert ">>>" in doc, f"mixprec.optax.{name} has no runnable example"
