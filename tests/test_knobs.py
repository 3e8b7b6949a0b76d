"""Automatic knobs (ktlite/runtime/knobs.py): every knob the user leaves out is chosen from the memory
plan and the hardware, the chosen config is one the plan accepts on every device, the values the
user sets are kept (and still fail with the knob named when they cannot fit), and `ktlite plan`
prints the same choice for a described machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from ktlite.cli import main
from ktlite.config import AUTO_KNOBS, EngineConfig
from ktlite.errors import ConfigError, PlanError
from ktlite.kernels.cpu.quant import empty_quantized
from ktlite.runtime.knobs import MIN_AUTO_CHUNK, TARGET_CONTEXT, Hardware, choose_knobs, cpu_expert_bytes, resolve
from ktlite.runtime.memory import PlanDoesNotFit, make_plan, plan_on
from ktlite.runtime.plan_inputs import PlanInputs, plan_inputs, splits
from ktlite.runtime.models import load_config

DATA = Path(__file__).parent / "data"
# the published configs these tests plan for; extend as families are added (each must load)
CONFIGS = ["deepseek-v3", "deepseek-v3.2", "deepseek-v2-lite", "qwen3-30b-a3b", "qwen3-235b-a22b", "minimax-m2",
           "glm-4.5", "qwen3-next-80b-a3b"]
MACHINES = {
    "1x24GiB": dict(gpus=1, gpu_memory="24GiB", cpu_memory="768GiB", cpu_cores=32, numa=1),
    "2x16GiB": dict(gpus=2, gpu_memory="16GiB", cpu_memory="768GiB", cpu_cores=64, numa=2),
    "no-gpu": dict(gpus=0, cpu_memory="768GiB", cpu_cores=32, numa=2),
}
def _config(name: str, **flags) -> EngineConfig:
    return EngineConfig.from_kwargs(str(DATA / name), **flags)


def _machine(key: str) -> Hardware:
    return Hardware.describe(**MACHINES[key])


@pytest.mark.parametrize("machine", list(MACHINES))
@pytest.mark.parametrize("name", CONFIGS)
def test_chosen_knobs_fit_every_device(name, machine):
    cfg, hardware = load_config(DATA / name), _machine(machine)
    try:
        choice = resolve(_config(name), cfg, hardware)
    except PlanDoesNotFit as exc:
        # refused only when no value of the automatic knobs could fit: the most GPUs the model splits
        # over, no GPU experts, the smallest chunk and KV pool ktlite would choose
        tp = max(t for t in range(1, max(hardware.gpus, 1) + 1) if splits(cfg, t))
        least = dataclasses.replace(exc.plan.inputs, tensor_parallel_size=tp, kt_num_gpu_experts=0,
                                    chunked_prefill_size=MIN_AUTO_CHUNK, max_total_tokens=MIN_AUTO_CHUNK)
        assert not plan_on(cfg, least, (exc.plan.ranks[0].device_bytes,) * tp).fits
        assert exc.suggestions and "To fit, change one of: " in str(exc)
        return
    plan = choice.plan
    for rank in plan.ranks:
        assert rank.static_bytes <= rank.static_budget and rank.headroom_bytes <= rank.headroom_budget
    # the runtime's own view of the chosen flags makes the same plan, and it fits
    device = "cuda" if hardware.gpus else "cpu"
    budget = hardware.gpu_memory or choice.config.gpu_memory
    again = make_plan(cfg, plan_inputs(dataclasses.replace(choice.config, device=device, gpu_memory=budget), cfg))
    assert (again.kv_pool_tokens, again.gpu_experts_total, again.chunk_tokens) == \
        (plan.kv_pool_tokens, plan.gpu_experts_total, plan.chunk_tokens)
    assert len(again.ranks) == choice.config.tensor_parallel_size <= max(hardware.gpus, 1)
    chosen = {r.flag for r in choice.rows if r.how.startswith("chosen:")}
    assert {"--" + k.replace("_", "-") for k in AUTO_KNOBS} <= chosen
    assert choice.config.kt_cpuinfer == hardware.physical_cores
    assert choice.config.kt_threadpool_count == hardware.numa_nodes
    assert choice.config.user_set is None and choice.cpu.fits


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3.2"])
def test_two_16gib_gpus_run_deepseek_with_tp2_unasked(name):
    choice = resolve(_config(name), load_config(DATA / name), _machine("2x16GiB"))
    assert choice.config.tensor_parallel_size == 2 and len(choice.plan.ranks) == 2
    assert "cannot hold the weights" in next(r.how for r in choice.rows if r.flag == "--tensor-parallel-size")


def test_gpu_experts_are_the_most_that_leave_the_kv_target():
    """V2-Lite on 24 GiB: some routed experts fit beside 64 x 4096 KV tokens, one more would not."""
    cfg = load_config(DATA / "deepseek-v2-lite")
    choice = resolve(_config("deepseek-v2-lite"), cfg, _machine("1x24GiB"))
    experts, target = choice.plan.gpu_experts_total, 64 * TARGET_CONTEXT
    assert 0 < experts < cfg.n_routed_experts and choice.plan.kv_pool_tokens >= target
    more = dataclasses.replace(choice.plan.inputs, kt_num_gpu_experts=experts + 1, max_total_tokens=None)
    assert plan_on(cfg, more, (24 * 2**30,)).kv_pool_tokens < target
    # what is left: the plan's rule, applied again to the free memory at load time
    assert choice.config.max_total_tokens is None
    assert next(r.value for r in choice.rows if r.flag == "--max-total-tokens") == f"{choice.plan.kv_pool_tokens:,}"


def test_values_you_set_are_kept_and_marked():
    cfg = load_config(DATA / "deepseek-v2-lite")
    config = _config("deepseek-v2-lite", kt_num_gpu_experts=3, chunked_prefill_size=1024, kt_cpuinfer=8)
    choice = resolve(config, cfg, _machine("1x24GiB"))
    c = choice.config
    assert (c.kt_num_gpu_experts, c.chunked_prefill_size, c.kt_cpuinfer) == (3, 1024, 8)
    how = {r.flag: r.how for r in choice.rows}
    assert how["--kt-num-gpu-experts"] == how["--chunked-prefill-size"] == how["--kt-cpuinfer"] == "set by you"
    assert how["--kt-threadpool-count"].startswith("chosen:") and how["--max-running-requests"] == "default"


def test_experts_ratio_wins_over_the_chosen_count():
    choice = resolve(_config("deepseek-v2-lite", kt_gpu_experts_ratio=0.25), load_config(DATA / "deepseek-v2-lite"),
                     _machine("1x24GiB"))
    assert choice.plan.gpu_experts_total == 16
    assert any(r.flag == "--kt-gpu-experts-ratio" and r.how == "set by you" for r in choice.rows)


def test_a_value_you_set_that_cannot_fit_fails_naming_the_knob():
    with pytest.raises(PlanDoesNotFit) as info:
        resolve(_config("deepseek-v3", kt_num_gpu_experts=64), load_config(DATA / "deepseek-v3"), _machine("1x24GiB"))
    assert "--kt-num-gpu-experts <= " in str(info.value)
    with pytest.raises(PlanDoesNotFit) as info:
        resolve(_config("deepseek-v3", max_total_tokens=200_000), load_config(DATA / "deepseek-v3"), _machine("1x24GiB"))
    assert "--max-total-tokens <= 18198" in str(info.value)


def test_a_small_kv_pool_lowers_the_default_chunk_instead_of_failing():
    cfg = load_config(DATA / "deepseek-v3")
    with pytest.raises(PlanDoesNotFit):  # the default chunk with a pool smaller than it: refused before
        make_plan(cfg, PlanInputs(gpu_memory="24GiB", max_total_tokens=3000))
    choice = resolve(_config("deepseek-v3", max_total_tokens=3000), cfg, _machine("1x24GiB"))
    assert choice.config.chunked_prefill_size == 3000 and choice.plan.kv_pool_tokens == 3000
    assert "capped by --max-total-tokens" in next(r.how for r in choice.rows if r.flag == "--chunked-prefill-size")


def test_the_default_chunk_shrinks_to_the_headroom():
    """With 0.97 of the GPU static, the 8192-token workspace no longer fits the headroom: a smaller
    chunk is chosen, the largest that does."""
    cfg = load_config(DATA / "deepseek-v3")
    with pytest.raises(PlanDoesNotFit):
        make_plan(cfg, PlanInputs(gpu_memory="24GiB", mem_fraction_static=0.97))
    choice = resolve(_config("deepseek-v3", mem_fraction_static=0.97), cfg, _machine("1x24GiB"))
    chunk = choice.config.chunked_prefill_size
    assert 256 <= chunk < 8192
    bigger = dataclasses.replace(choice.plan.inputs, chunked_prefill_size=chunk + 1, max_total_tokens=None)
    assert not plan_on(cfg, bigger, (24 * 2**30,)).fits


def test_no_gpu_keeps_experts_on_cpu_and_sizes_the_pool_for_the_target():
    choice = resolve(_config("qwen3-30b-a3b"), load_config(DATA / "qwen3-30b-a3b"), _machine("no-gpu"))
    c = choice.config
    assert (c.tensor_parallel_size, c.kt_num_gpu_experts) == (1, 0)
    assert c.max_total_tokens == 64 * TARGET_CONTEXT and c.gpu_memory == 384 * 2**30
    assert choice.cpu.device_bytes > 0  # the device side shares the RAM with the experts


def test_routed_experts_must_fit_in_ram_in_the_chosen_method():
    cfg = load_config(DATA / "deepseek-v3")
    machine = dict(MACHINES["1x24GiB"], cpu_memory="500GiB")
    int4 = resolve(_config("deepseek-v3"), cfg, Hardware.describe(**machine))
    assert int4.cpu.fits and "INT4" in int4.cpu.text()
    config = _config("deepseek-v3", kt_method="INT8")
    int8 = resolve(config, cfg, Hardware.describe(**machine))
    assert not int8.cpu.fits
    with pytest.raises(PlanError, match="--kt-method INT4"):
        choose_knobs(config, cfg, Hardware.describe(**machine))


@pytest.mark.parametrize("method, group", [("INT4", 64), ("INT8", 32), ("BF16", 64), ("RAWINT4", 64)])
def test_cpu_expert_bytes_equal_the_store(tiny_v2, method, group):
    cfg = load_config(tiny_v2)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    stored_as, stored_group = ("INT4", 32) if method == "RAWINT4" else (method, group)
    stored = sum(empty_quantized(stored_as, stored_group, (), n, k).nbytes() for n, k in ((i, h), (i, h), (h, i)))
    assert cpu_expert_bytes(cfg, method, group) == stored
    assert cpu_expert_bytes(cfg, "LLAMAFILE", group) is None  # the GGUF file's own size


def test_fp8_experts_are_counted_in_their_checkpoint_blocks():
    cfg = load_config(DATA / "deepseek-v3")  # block-FP8, 128 x 128
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    stored = sum(empty_quantized("FP8", 128, (), n, k).nbytes() for n, k in ((i, h), (i, h), (h, i)))
    assert cpu_expert_bytes(cfg, "FP8", 64) == stored


def test_choosing_twice_changes_nothing(tiny_v3):
    config = EngineConfig.from_kwargs(str(tiny_v3), max_running_requests=4)
    assert config.user_set == {"max_running_requests"}
    chosen, rows = choose_knobs(config, load_config(tiny_v3))
    assert rows and chosen.user_set is None and chosen.max_running_requests == 4
    assert choose_knobs(chosen, load_config(tiny_v3)) == (chosen, [])


def test_tp_you_set_beyond_the_gpus_is_refused():
    with pytest.raises(ConfigError, match="only 2 GPUs"):
        resolve(_config("deepseek-v3", tensor_parallel_size=4), load_config(DATA / "deepseek-v3"), _machine("2x16GiB"))


def test_cli_plan_picks_knobs_for_a_described_machine():
    args = ["plan", "--model", str(DATA / "deepseek-v3"), "--gpu-memory", "16GiB", "--gpus", "2", "--cpu-memory",
            "768GiB", "--cpu-cores", "64", "--numa-nodes", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "2 GPUs x 16.00 GiB" in out and "GPU 1 of 2" in out and "verdict: fits" in out
    for line in ("--tensor-parallel-size", "--kt-num-gpu-experts", "--max-total-tokens", "--chunked-prefill-size",
                 "--kt-cpuinfer", "--kt-threadpool-count"):
        assert any(l.strip().startswith(line) and "chosen:" in l for l in out.splitlines()), line
    assert "routed experts on the CPU: 342.56 GiB in INT4" in out and "768.00 GiB RAM: fit" in out


def test_cli_plan_fails_when_the_experts_do_not_fit_the_described_ram():
    args = ["plan", "--model", str(DATA / "deepseek-v3"), "--gpu-memory", "24GiB", "--cpu-memory", "256GiB"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "do NOT fit" in result.output
    assert "a machine with at least 342.56 GiB" in result.stderr
