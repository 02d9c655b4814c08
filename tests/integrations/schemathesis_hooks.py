"""Schemathesis hooks for test_server_openai.py (loaded through ``SCHEMATHESIS_HOOKS``; not a test module).

``positive_data_acceptance_within_schema``: schemathesis' ``positive_data_acceptance`` (a request the schema
calls valid must not be refused), except for the 400s whose ``error.code`` names a limit no JSON Schema can
state, which the server's schema lists in its 400 response and docs/inference.md explains: prompt tokens +
new tokens within the context (a count of tokens of free text), min_tokens against max_tokens and prompts x n
(relations between two numbers), a prompt that encodes to no token. Every other refusal of a schema-valid
request still fails the check.
"""

from __future__ import annotations

import os
from pathlib import Path

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

OUTSIDE_SCHEMA = {
    "context_length_exceeded",
    "min_tokens_above_max_tokens",
    "too_many_generations",
    "empty_prompt",
}


@schemathesis.check
def positive_data_acceptance_within_schema(ctx, response, case):
    if os.environ.get("SHARDSPEED_CHECK_RAN"):  # the test's proof that `--checks all` included this check
        Path(os.environ["SHARDSPEED_CHECK_RAN"]).touch()
    if response.status_code == 400:
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if code in OUTSIDE_SCHEMA:
            return None
    return positive_data_acceptance(ctx, response, case)
