"""Every public attention function's ``def`` line is its real signature, and they agree: query,
key and value by position, then the :class:`~octlm.attention.inputs.Call` keywords each takes,
in the call's order with its defaults and types (the fields :func:`check` validates), then the
function's own keywords, alike wherever two functions share one."""

from __future__ import annotations

import ast
import inspect
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

import octlm
from octlm.attention import IMPLEMENTATIONS, route
from octlm.attention.inputs import Call

CALL = {field.name: field for field in fields(Call)}
KEYWORDS = [field.name for field in fields(Call) if field.kw_only]
TRITON = Path(__file__).resolve().parents[2] / "src/octlm/attention/tiled/triton_flash.py"


def _triton_parameters() -> list[tuple[str, str, object, bool]]:
    """triton_attention's parameters from its source (importing it needs Triton, and Triton
    must not be imported before tests/attention/test_triton.py sets its interpreter up)."""
    tree = ast.parse(TRITON.read_text())
    found = next(
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "triton_attention"
    )
    arguments = found.args
    rows = [(a.arg, ast.unparse(a.annotation), MISSING, False) for a in arguments.args]
    for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True):
        value = ast.literal_eval(default)
        rows.append((argument.arg, ast.unparse(argument.annotation), value, True))
    return rows


def _parameters(function) -> list[tuple[str, str, object, bool]]:
    """``(name, annotation, default, keyword-only)`` of each parameter, in order."""
    rows = []
    for parameter in inspect.signature(function).parameters.values():
        default = MISSING if parameter.default is inspect.Parameter.empty else parameter.default
        keyword = parameter.kind is inspect.Parameter.KEYWORD_ONLY
        rows.append((parameter.name, parameter.annotation, default, keyword))
    return rows


PUBLIC = {name: impl.function for name, impl in IMPLEMENTATIONS.items()} | {"route": route}
SIGNATURES = {name: _parameters(function) for name, function in PUBLIC.items()}
SIGNATURES["triton"] = _triton_parameters()


@pytest.mark.parametrize("name", SIGNATURES)
def test_each_signature_is_the_calls_fields_then_its_own(name):
    rows = SIGNATURES[name]
    assert [(n, a, k) for n, a, _, k in rows[:3]] == [
        (field, CALL[field].type, False) for field in ("query", "key", "value")
    ]
    assert all(default is MISSING for _, _, default, _ in rows[:3])
    shared = [row for row in rows[3:] if row[0] in CALL]
    own = [row for row in rows[3:] if row[0] not in CALL]
    assert rows[3:] == shared + own  # the call's keywords first
    assert [row[0] for row in shared] == [k for k in KEYWORDS if k in {r[0] for r in shared}]
    for keyword, annotation, default, keyword_only in shared:
        field = CALL[keyword]
        assert (annotation, default, keyword_only) == (field.type, field.default, True), keyword
    assert all(keyword_only for *_, keyword_only in own)
    if name != "ring":  # the ring takes no mask_mod, padding on the left or block mask
        assert {"key_starts", "document_ids", "softcap"} <= {row[0] for row in shared}


def test_a_keyword_two_functions_share_means_the_same():
    seen: dict[str, tuple[str, object]] = {}
    for rows in SIGNATURES.values():
        for keyword, annotation, default, _ in rows[3:]:
            assert seen.setdefault(keyword, (annotation, default)) == (annotation, default), keyword


def test_the_registered_features_are_in_the_signatures():
    for name, impl in IMPLEMENTATIONS.items():
        taken = {row[0] for row in SIGNATURES[name]}
        assert set(impl.features) | set(impl.tuning) <= taken, name


def test_auto_and_route_are_exported_from_octlm():
    assert octlm.auto_attention is IMPLEMENTATIONS["auto"].function
    assert octlm.route is route
