"""The worker's flags: checked when the config is built, the offending flag named; and the
timeouts of an admission agree across the services."""

import pytest

from gateway.config import GatewayConfig
from gpu_worker.config import WorkerConfig
from grammar_service.config import GrammarServiceConfig


def test_admit_timeout_not_above_grammar_fetch_timeout_is_refused_with_both_flags_named():
    with pytest.raises(ValueError, match="--admit-timeout must be greater than "
                                         "--grammar-fetch-timeout"):
        WorkerConfig.from_args(["--admit-timeout", "10", "--grammar-fetch-timeout", "10"])
    with pytest.raises(ValueError, match="--grammar-fetch-timeout must be > 0"):
        WorkerConfig.from_args(["--grammar-fetch-timeout", "0"])
    cfg = WorkerConfig.from_args(["--admit-timeout", "11", "--grammar-fetch-timeout", "10"])
    assert (cfg.admit_timeout_s, cfg.grammar_fetch_timeout_s) == (11, 10)


def test_default_timeouts_let_the_slowest_compile_finish_inside_an_admission():
    # The gateway gets its grammar compiled before it takes a slot; rank 0 pins its grammar
    # before it allocates. A follower fetches after the allocation, and that fetch may make
    # the grammar service recompile an evicted grammar: compile < fetch < admission.
    compile_timeout = GrammarServiceConfig().compile_timeout
    worker = WorkerConfig.from_args([])
    assert compile_timeout < worker.grammar_fetch_timeout_s < worker.admit_timeout_s


@pytest.mark.parametrize("field,value,flag", [
    ("unavailable_wait", -1.0, "--unavailable-wait"),
    ("drain_timeout", -0.5, "--drain-timeout"),
])
def test_bad_gateway_fault_flags_are_refused_with_the_flag_named(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        GatewayConfig(grammar_service="g:1", groups=(("h:1",),), **{field: value})


def test_fused_sampling_flag_takes_auto_on_off_and_its_environment_variable(monkeypatch):
    assert WorkerConfig.from_args([]).fused_sampling == "auto"
    assert WorkerConfig.from_args(["--fused-sampling", "off"]).fused_sampling == "off"
    monkeypatch.setenv("GRAMSERVE_FUSED_SAMPLING", "on")
    assert WorkerConfig.from_args([]).fused_sampling == "on"
    monkeypatch.setenv("GRAMSERVE_FUSED_SAMPLING", "sometimes")
    with pytest.raises(ValueError, match="--fused-sampling"):
        WorkerConfig.from_args([])
