"""Verify many layouts with one torchrun launch per world size (``verify.verify_many``).

A test module registers how it builds its cases with :func:`verify_fixture` and gets a
fixture; its parametrised tests read their case's result with :func:`result_of`. The first
test that asks runs every case selected in this session (``-k``, node ids), of every module
that registered, grouped by world size: one launch of 2, one of 4, one of 8 processes,
instead of one launch per case (10-30 s each to start on 2 cores).
"""

from __future__ import annotations

from typing import Callable

import pytest

from parcompile.verification import VerifyResult, verify_many

#: module name -> (build, param, steps, per_test) of every module that registered
_BUILDERS: dict[str, tuple[Callable, str, int, bool]] = {}
_RESULTS: dict[tuple, VerifyResult | Exception] = {}


def _selected(session: pytest.Session) -> list[tuple[str, str, object]]:
    """``(module, test function, case)`` of every selected test of a registered module."""
    seen: list[tuple[str, str, object]] = []
    for item in session.items:
        module = getattr(getattr(item, "module", None), "__name__", None)
        callspec = getattr(item, "callspec", None)
        if module in _BUILDERS and callspec and _BUILDERS[module][1] in callspec.params:
            key = (module, item.originalname if _BUILDERS[module][3] else "", callspec.params[_BUILDERS[module][1]])
            if key not in seen and key not in _RESULTS:
                seen.append(key)
    return seen


def verify_fixture(module: str, build: Callable[[str, object], tuple], param: str = "case", steps: int = 3,
                   per_test: bool = True):
    """Register ``build`` for the test module ``module`` (pass ``__name__``) and return a
    fixture giving the results ``{(module, test name, case): VerifyResult | Exception}``.

    ``build(test name, case)`` gives ``(SpecConfig, dtype)``, ``(SpecConfig, dtype,
    Tolerances)`` or ``(SpecConfig, dtype, Tolerances or None, edit)`` (``edit``: a function
    given the miniature's directory before it runs, ``verify_many``'s ``edits``); cases of
    modules with the same ``steps`` share launches (training and serve specs alike).
    ``per_test=False``: a case is run once for all the module's tests that ask for it
    (``build`` gets ``""`` as the test name)."""
    _BUILDERS[module] = (build, param, steps, per_test)

    @pytest.fixture
    def fixture(request, tmp_path_factory):
        todo = [k for k in _selected(request.session) if _BUILDERS[k[0]][2] == steps]
        if todo:
            cfgs, dtypes, tols, edits = {}, {}, {}, {}
            for key in todo:
                cfg, dtype, *more = _BUILDERS[key[0]][0](key[1], key[2])
                cfgs[key], dtypes[key] = cfg, dtype
                if more and more[0] is not None:
                    tols[key] = more[0]
                if len(more) > 1:
                    edits[key] = more[1]
            _RESULTS.update(verify_many(cfgs, steps=steps, workdir=tmp_path_factory.mktemp("verify"),
                                        dtypes=dtypes, tols=tols, edits=edits))
        return _RESULTS

    return fixture


def result_of(results: dict, request: pytest.FixtureRequest, case) -> VerifyResult:
    """This test's result; re-raises the exception its layout raised."""
    module = request.module.__name__
    result = results[(module, request.node.originalname if _BUILDERS[module][3] else "", case)]
    if isinstance(result, Exception):
        raise result
    return result
