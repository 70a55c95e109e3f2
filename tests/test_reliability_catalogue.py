"""Every case of the reliability catalogue (tests/catalogue_cases.py; the C ABI's in tests/catalogue_native.py) is
handled: the user's files are intact, no scratch folder is left, a failure is one what/why/fix line with no
traceback, and it ends in bounded time.

docs/reliability.md is this catalogue's table, before and after (scripts/lab/reliability_table.py prints it).
"""
from __future__ import annotations

import pytest

from catalogue import Workspace, execute
from catalogue_cases import CASES
from catalogue_native import CASES as NATIVE_CASES
from catalogue_fixtures import build_fixtures


@pytest.fixture(scope="session")
def catalogue_fixtures(tmp_path_factory):
    return build_fixtures(tmp_path_factory.mktemp("catalogue-fixtures"))


@pytest.mark.parametrize("case", CASES + NATIVE_CASES, ids=[c.id for c in CASES + NATIVE_CASES])
def test_case_is_handled(case, catalogue_fixtures, tmp_path):
    workspace = Workspace(tmp_path / "w", catalogue_fixtures)
    outcome = execute(case, workspace)
    assert not outcome.problems(case, workspace), (
        f"{case.what}: {outcome.summary()}\nstderr:\n{outcome.stderr[-3000:]}")
