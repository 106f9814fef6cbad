"""Tests for the op lists (``OpLists``) and ``modify_mixlist``, Ascend AMP's
JSON format for editing them (its documented examples are the spec)."""

import dataclasses
import json

import pytest

from mixprec._src.autocast import mixlist as mixlist_lib, ops
from mixprec._src.autocast.mixlist import modify_mixlist
from mixprec._src.autocast.ops import OpLists, default_op_lists


INFER = default_op_lists().infer
DENY = default_op_lists().deny
HIGHER_ORDER = frozenset(s.name for s in ops.all_specs() if s.is_higher_order)
KNOWN_NAMES = frozenset(s.name for s in ops.all_specs())


# ----------------------------------------------------------------- OpLists


def test_oplists_rejects_overlap_and_bad_types():
    with pytest.raises(ValueError, match="both `allow` and `deny`"):
        OpLists(allow={"exp"}, deny={"exp"})
    with pytest.raises(TypeError, match=r"`OpLists\(allow=...\)`"):
        OpLists(allow="exp")  # type: ignore[arg-type]


def test_oplists_is_frozen_hashable_and_normalises_to_frozensets():
    lists = OpLists(allow=["dot_general"], deny=("exp",))
    assert isinstance(lists.allow, frozenset) and isinstance(lists.deny, frozenset)
    assert hash(lists) == hash(OpLists(allow={"dot_general"}, deny={"exp"}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lists.allow = frozenset()  # type: ignore[misc]


def test_classify_unknown_and_strict():
    lists = default_op_lists()
    assert lists.classify("my_custom_prim") == "infer"
    with pytest.raises(NotImplementedError, match="'my_custom_prim'"):
        lists.classify("my_custom_prim", strict=True)
    with pytest.raises(NotImplementedError, match="Did you mean 'dot_general'"):
        lists.classify("dot_generl", strict=True)
    assert lists.classify("scan", strict=True) == "clear"


def test_default_lists_come_from_the_op_table():
    lists = default_op_lists()
    for spec in ops.all_specs():
        if spec.is_higher_order:
            assert spec.name not in lists.names()
        else:
            assert lists.classify(spec.name) == spec.op_class, spec.name
    assert lists.as_dict()["allow"] == sorted(lists.allow)


# ----------------------------------------------------------- modify_mixlist


def _cls(lists, name):
    return lists.classify(name)


def test_ascend_example_example_add_to_black_moves_from_white():
    # "(正确示例)用户将该算子添加到黑名单中" — A (dot_general) is white by default.
    assert _cls(default_op_lists(), "dot_general") == "allow"
    lists = modify_mixlist(None, {"black-list": {"to-add": ["dot_general"]}})
    assert _cls(lists, "dot_general") == "deny"
    assert "dot_general" not in lists.allow


def test_ascend_example_example_remove_from_white_and_add_to_black():
    spec = {
        "black-list": {"to-add": ["dot_general"]},
        "white-list": {"to-remove": ["dot_general"]},
    }
    assert _cls(modify_mixlist(None, spec), "dot_general") == "deny"


def test_ascend_example_example_remove_from_white_only_leaves_gray():
    # "(错误示例)... 最终该算子在灰名单中,而不是黑名单"
    lists = modify_mixlist(None, {"white-list": {"to-remove": ["dot_general"]}})
    assert _cls(lists, "dot_general") == "infer"
    assert "dot_general" in lists.infer


def test_ascend_example_example_remove_from_black_only_leaves_gray():
    lists = modify_mixlist(None, {"black-list": {"to-remove": ["exp"]}})
    assert _cls(lists, "exp") == "infer"


# Ascend's ops_info.json example, with its // comments, in JAX names: Yolo -> exp
# (black), Matmul -> dot_general, Cast -> convert_element_type, Conv2D ->
# conv_general_dilated, Bias -> add.
ASCEND_JSON = """
{ "black-list": { // 黑名单
    "to-remove": [ // 黑名单算子转换为灰名单算子
      "exp"
    ],
    "to-add": [ // 白名单或灰名单算子转换为黑名单算子
      "dot_general", "convert_element_type"
    ]
  },
  "white-list": { // 白名单
    "to-remove": [ // 白名单算子转换为灰名单算子
      "conv_general_dilated"
    ],
    "to-add": [ // 黑名单或灰名单算子转换为白名单算子
      "add"
    ]
  }
}
"""
ASCEND_EXPECTED = {
    "exp": "infer",
    "dot_general": "deny",
    "convert_element_type": "deny",
    "conv_general_dilated": "infer",
    "add": "allow",
}


def _check_ascend(lists):
    for name, cls in ASCEND_EXPECTED.items():
        assert _cls(lists, name) == cls, name
    defaults = default_op_lists()
    for name in KNOWN_NAMES - set(ASCEND_EXPECTED) - HIGHER_ORDER:
        assert _cls(lists, name) == _cls(defaults, name), name


def test_ascend_example_ops_info_json_string():
    _check_ascend(modify_mixlist(None, ASCEND_JSON))


def test_ascend_example_ops_info_json_file(tmp_path):
    path = tmp_path / "ops_info.json"
    path.write_text(ASCEND_JSON, encoding="utf-8")
    _check_ascend(modify_mixlist(None, path))
    _check_ascend(modify_mixlist(default_op_lists(), str(path)))


def test_ascend_example_ops_info_dict():
    spec = json.loads(mixlist_lib._strip_line_comments(ASCEND_JSON))
    _check_ascend(modify_mixlist(None, spec))


def test_comment_stripper_keeps_slashes_in_strings():
    text = '{"a": "x//y", "b": "q\\\\"} // trailing'
    assert json.loads(mixlist_lib._strip_line_comments(text)) == {
        "a": "x//y",
        "b": "q\\",
    }


def test_modify_does_not_mutate_input_and_is_composable():
    base = default_op_lists()
    lists = modify_mixlist(base, {"white-list": {"to-add": ["exp"]}})
    assert _cls(base, "exp") == "deny" and _cls(lists, "exp") == "allow"
    back = modify_mixlist(lists, {"black-list": {"to-add": ["exp"]}})
    assert back == base


def test_gray_and_clear_lists():
    lists = modify_mixlist(None, {"gray-list": {"to-add": ["exp", "reshape"]}})
    assert _cls(lists, "exp") == "infer" and _cls(lists, "reshape") == "infer"
    lists = modify_mixlist(None, {"clear-list": {"to-add": ["tanh"]}})
    assert _cls(lists, "tanh") == "clear"
    spec = {"gray-list": {"to-remove": ["tanh"]}, "white-list": {"to-add": ["tanh"]}}
    assert _cls(modify_mixlist(None, spec), "tanh") == "allow"
    lists = modify_mixlist(None, {"clear-list": {"to-remove": ["reshape"]}})
    assert _cls(lists, "reshape") == "infer"


def test_adding_to_own_list_is_a_no_op():
    lists = modify_mixlist(None, {"black-list": {"to-add": ["exp", "exp"]}})
    assert lists == default_op_lists()
    assert modify_mixlist(None, {}) == default_op_lists()


def test_custom_names_already_in_lists_are_accepted():
    lists = dataclasses.replace(default_op_lists(), infer=INFER | {"my_prim"})
    lists = modify_mixlist(lists, {"white-list": {"to-add": ["my_prim"]}})
    assert _cls(lists, "my_prim") == "allow"


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            {"black-list": {"to-add": ["dot_genral"]}},
            "unknown op 'dot_genral'.*'dot_general'",
        ),
        ({"black-list": {"to-add": ["Matmul"]}}, "'dot_general' \\(the JAX primitive"),
        ({"white-list": {"to-add": ["Conv2D"]}}, "'conv_general_dilated'"),
        ({"blacklist": {"to-add": ["exp"]}}, "unknown key 'blacklist'.*'black-list'"),
        ({"black-list": {"to_add": ["exp"]}}, "unknown key 'to_add'.*'to-add'"),
        (
            {"black-list": {"to-add": ["exp"], "to-remove": ["exp"]}},
            "'exp' is both added to and removed from 'black-list'",
        ),
        (
            {"black-list": {"to-add": ["add"]}, "white-list": {"to-add": ["add"]}},
            "'add' is added to both",
        ),
        ({"white-list": {"to-remove": ["exp"]}}, "cannot remove 'exp'.*deny list"),
        ({"gray-list": {"to-remove": ["add"]}}, "not added to another list"),
        ({"black-list": {"to-add": "exp"}}, "must be a list of op names"),
        ({"black-list": ["exp"]}, "'black-list' must be an object"),
        ({"black-list": {"to-add": [3]}}, "must be strings"),
        ({"black-list": {"to-add": ["scan"]}}, "'scan'.*higher-order"),
        ({"black-list": {"to-add": ["ffi_call"]}}, "'ffi_call'.*opaque"),
        ('{"black-list": {"to-add": ["exp"]', "malformed JSON.*line 1"),
        ("{'black-list': {}}", "malformed JSON"),
        ("[1, 2]", "must be a JSON object"),
        ("no_such_file.json", "neither a JSON file nor JSON text"),
    ],
)
def test_modify_mixlist_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        modify_mixlist(None, spec)


def test_modify_mixlist_errors_for_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"black-list": {"to-add": ["exp",]}}\n')
    with pytest.raises(ValueError, match="malformed JSON in file .*bad.json"):
        modify_mixlist(None, bad)
    with pytest.raises(ValueError, match="neither a JSON file"):
        modify_mixlist(None, tmp_path / "missing.json")
    with pytest.raises(ValueError, match="neither a JSON file"):
        modify_mixlist(None, tmp_path)


def test_modify_mixlist_type_errors():
    with pytest.raises(TypeError, match=r"`modify_mixlist\(spec=...\)` must be"):
        modify_mixlist(None, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`modify_mixlist\(lists=...\)` must be"):
        modify_mixlist({"allow": []}, {})  # type: ignore[arg-type]


def test_modify_mixlist_rejects_duplicate_json_keys():
    text = '{"black-list": {"to-add": ["exp"]}, "black-list": {"to-add": ["log"]}}'
    with pytest.raises(ValueError, match="duplicate key 'black-list'"):
        modify_mixlist(None, text)


def test_oplists_rejects_non_string_names_and_supports_replace():
    with pytest.raises(TypeError, match="must contain op names"):
        OpLists(allow=[1])  # type: ignore[list-item]
    lists = dataclasses.replace(default_op_lists(), allow=["dot_general"])
    assert lists.allow == frozenset({"dot_general"})
    assert lists.classify("conv_general_dilated") == "infer"


def test_oplists_repr_is_compact():
    text = repr(default_op_lists())
    assert text.startswith("OpLists(allow=['conv_general_dilated'")
    assert f"({len(DENY)} names)" in text
    assert len(text) < 600
