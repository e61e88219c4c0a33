import pytest

from clgrpo.llm.structured import StructuredOutputError, extract_json, parse_operations
from schemas.records import OpKind


@pytest.mark.parametrize(
    "reply",
    [
        '{"operations": [{"op": "add", "text": "Check units."}]}',
        'Sure! ```json\n{"operations": [{"op": "add", "text": "Check units."}]}\n```',
        '```\n{"operations": [\n  // a comment\n  {"op": "add", "text": "Check units.",},\n]}\n```',
        'Here is my plan: {"operations": [{"op": "add", /* why */ "text": "Check units."}]} Thanks.',
        '<think>maybe {"x": 1</think>{"operations": [{"op": "add", "text": "Check units."}]}',
        '[{"op": "ADD", "text": "Check units."}]',
        '{"operations": [{"operation": "add", "content": "Check units."}]}',
    ],
)
def test_tolerant_extraction_of_operations(reply):
    ops = parse_operations(reply)
    assert [(o.op, o.text) for o in ops] == [(OpKind.ADD, "Check units.")]


def test_strings_with_comment_markers_and_braces_survive():
    payload = extract_json('{"text": "use // and /* */ and {braces}, ok",}')
    assert payload == {"text": "use // and /* */ and {braces}, ok"}


def test_field_aliases_and_id_normalisation():
    ops = parse_operations(
        '{"operations": [{"op": "merge", "ids": ["E1", 4], "text": "t", "why": "same", '
        '"sources": ["p1"]}, {"action": "delete", "id": "E2"}]}'
    )
    assert ops[0].target_ids == ["E1", "4"] and ops[0].rationale == "same" and ops[0].source_groups == ["p1"]
    assert ops[1].op == OpKind.DELETE and ops[1].target_ids == ["E2"]


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ("", "empty reply"),
        ("I would add a lesson about units.", "no JSON object found"),
        ('{"ops": []}', 'expected {"operations": [...]}'),
        ('{"operations": {"op": "add"}}', '"operations" must be a list'),
        ('{"operations": [{"op": "rewrite", "text": "x"}]}', "op 'rewrite' is not one of"),
        ('{"operations": ["add"]}', "operation must be an object"),
    ],
)
def test_unusable_replies_raise_with_a_reason(reply, error):
    with pytest.raises(StructuredOutputError, match=error.replace("[", r"\[").replace("{", r"\{")):
        parse_operations(reply)


def test_empty_operations_list_is_valid():
    assert parse_operations('{"operations": []}') == []
