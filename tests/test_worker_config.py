"""The worker's flags: checked when the config is built, the offending flag named; and the
timeouts of an admission agree across the services."""

import pytest

from gateway.config import GatewayConfig
from gpu_worker.config import WorkerConfig, cuda_device_index
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


def test_each_rank_of_a_group_gets_its_own_gpu_and_groups_spread_over_the_host():
    # Rank r of a group runs on visible device (offset + r) mod count: a TP=2 group on a
    # 2-GPU host takes both, TP=2 groups 0 and 1 (offsets 0, 2) on 4 GPUs take 0-1 and 2-3,
    # two TP=1 groups on one GPU share it.
    assert [cuda_device_index(r, 2, 0, 2) for r in range(2)] == [0, 1]
    assert [cuda_device_index(r, 2, 2, 4) for r in range(2)] == [2, 3]
    assert [cuda_device_index(0, 1, g, 1) for g in range(2)] == [0, 0]
    assert [cuda_device_index(r, 2, 2, 2) for r in range(2)] == [0, 1]  # wraps, still distinct
    with pytest.raises(ValueError, match="--tp 2 needs 2 CUDA devices, 1 visible"):
        cuda_device_index(1, 2, 0, 1)
    with pytest.raises(ValueError, match="no CUDA device"):
        cuda_device_index(0, 1, 0, 0)
    assert WorkerConfig.from_args([]).gpu_offset == 0
    assert WorkerConfig.from_args(["--gpu-offset", "4"]).gpu_offset == 4
    with pytest.raises(ValueError, match="--gpu-offset"):
        WorkerConfig.from_args(["--gpu-offset", "-1"])


def test_up_gives_each_group_the_gpu_offset_of_its_first_rank(monkeypatch, tmp_path):
    """`gramserve up --groups 3 --tp 2`: group g's launcher passes --gpu-offset 2g to its
    ranks. The children's command lines are recorded here instead of started."""
    from gateway.launcher import System, UpConfig
    from grammar_service.default_model import ensure_default_model

    commands = {}
    monkeypatch.setattr(System, "_spawn",
                        lambda self, name, kind, command, addrs: commands.update({name: command}))
    System(UpConfig(model=str(ensure_default_model(tmp_path)), tp=2, groups=3)).start()
    offsets = []
    for g in range(3):
        args = commands[f"group{g}"]()
        assert args[args.index("--tp") + 1] == "2"
        offsets.append(args[args.index("--gpu-offset") + 1])
    assert offsets == ["0", "2", "4"]
