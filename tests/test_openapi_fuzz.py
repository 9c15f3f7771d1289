"""A bounded schemathesis run over the real server's OpenAPI document (issue #11).

Schemathesis generates requests from the document (`server/openapi.py`: the bodies are the pydantic
models that validate them) and checks every answer: never a 5xx, every status code and content type
documented, every body matching its documented schema. Generation is bounded (examples per operation,
and max_tokens/n clamped after generation) so the run takes a minute or two, not hours of decoding.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is a dev dependency")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from server_fixture import running_server  # noqa: E402

pytestmark = pytest.mark.slow
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def api_schema():
    with running_server("--max-model-len", "128", "--max-num-seqs", "8", "--max-queued-requests", "8") as srv:
        yield schemathesis.openapi.from_url(f"{srv.base_url}/openapi.json")


def bounded(case) -> None:
    """Bound the work a generated request asks for; the shape stays what was generated."""
    if isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(key), int):
                case.body[key] = min(case.body[key], 4)
        case.body.setdefault("max_tokens", 4)


def test_no_5xx_and_answers_match_the_document(api_schema) -> None:
    # Operations driven one by one with hypothesis (schemathesis' pytest fixture loader does not run
    # under pytest 9); the same strategies and checks as `schemathesis run`.
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def run(case) -> None:
            bounded(case)
            case.call_and_validate(checks=CHECKS, timeout=120)

        run()


@pytest.fixture(scope="module")
def v2_schema(tmp_path_factory):
    from server_fixture import example_repository

    root = example_repository(tmp_path_factory.mktemp("repo"))
    with running_server("--max-model-len", "128", "--model-repository", str(root)) as srv:
        yield schemathesis.openapi.from_url(f"{srv.base_url}/openapi.json")


def test_v2_answers_match_the_document(v2_schema) -> None:
    """KServe v2 over a model repository (issue #51, item 9): readiness by status code alone, every
    error {"error": message} with a documented status code, never a 5xx. Loads and unloads are left out:
    generated names and bodies would unload the models the other operations need."""
    operations = [result.ok() for result in v2_schema.get_all_operations()]
    v2 = [op for op in operations if op.path.startswith("/v2") and "load" not in op.path]
    assert any(op.path.endswith("/infer") for op in v2)
    for op in v2:

        @given(case=op.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def run(case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=120)

        run()
