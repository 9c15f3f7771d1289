"""Request bodies parsed with limits: JSON nesting depth, integer length, and text that is valid Unicode.

Python's JSON decoder accepts lone UTF-16 surrogates ("\\ud800"), recurses once per nesting level and
refuses integers longer than sys.get_int_max_str_digits() with a bare ValueError; the first made the
tokenizer and the engine protocol fail later with a 500, the others a 500 from RecursionError or
ValueError. All are the client's mistake and get a 400 here, before anything else sees them.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # far beyond any OpenAI or KServe body (tool schemas nest a handful of levels)


class BodyError(ValueError):
    """The body is not acceptable JSON; the message says why, for the client."""


def parse_json(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    try:
        data = json.loads(raw)
    except RecursionError as e:
        raise BodyError(f"the request body nests deeper than {max_depth} levels") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"the request body is not valid JSON: {e}") from e
    except ValueError as e:  # what else the decoder refuses: an integer past sys.get_int_max_str_digits()
        what = "an integer with too many digits" if "digits" in str(e) else "a value it cannot read"
        raise BodyError(f"the request body is not valid JSON: {what}") from e
    _check(data, max_depth)
    return data


def _check(value: Any, max_depth: int) -> None:
    # Iterative, so a deep body cannot exhaust the stack here either.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v)
        elif isinstance(v, dict | list):
            if depth > max_depth:
                raise BodyError(f"the request body nests deeper than {max_depth} levels")
            if isinstance(v, dict):
                for k, item in v.items():
                    _check_text(k)
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in v)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BodyError(
            f"the request body has text that is not valid Unicode (a lone surrogate at position {e.start})"
        ) from e
