"""The gateway's readiness: which capability each health input turns off, and the /ready body."""

import pytest

from gateway.health import COMPILE, GENERATE, Readiness


def _r(draining=False, healthy=1, up=True, cached=3) -> Readiness:
    return Readiness(draining=draining, healthy_groups=healthy, groups=2,
                     grammar_service_up=up, cached_grammars=cached)


@pytest.mark.parametrize(("readiness", "status", "generate", "compile_"), [
    (_r(), "ready", True, True),
    (_r(up=False), "degraded", True, False),  # cached grammars and unguided still serve
    (_r(healthy=0), "unavailable", False, True),  # CompileGrammar still answers
    (_r(healthy=0, up=False), "unavailable", False, False),
    (_r(draining=True), "unavailable", False, False),  # a drain refuses everything
])
def test_each_input_turns_off_only_its_capability(readiness, status, generate, compile_):
    assert readiness.status == status
    assert readiness.serving() == {GENERATE: generate, COMPILE: compile_}


def test_ready_body_names_every_capability_and_its_cause():
    assert _r(healthy=1, up=False, cached=7).as_dict() == {
        "status": "degraded", "generate": True, "compile": False, "draining": False,
        "healthy_groups": 1, "groups": 2, "grammar_service": "unavailable",
        "cached_grammars": 7}
