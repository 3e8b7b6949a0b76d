"""Build the runtime from a checkpoint folder and the flags: plan first, then allocate and load.

Order matters for the promise "an impossible config fails before allocating": the memory plan is
made from config.json alone and raises before any tensor exists. Then the device model (everything
but routed experts), the GPU expert buffers and the KV pool are allocated through the plan, the
CPU experts are quantized into the CPU store layer by layer, and the kernels are warmed up.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch

from ktlite.config import EngineConfig
from ktlite.kernels.cpu.moe import CPUMoE
from ktlite.runtime import models
from ktlite.runtime.cpu_dense import apply_cpu_dense
from ktlite.runtime.expert_sources import open_source
from ktlite.runtime.experts import DynamicPlacement, ExpertStats, initial_placement
from ktlite.runtime.hybrid_moe import HybridMoE, alloc_gpu_experts
from ktlite.runtime.knobs import choose_knobs
from ktlite.runtime.kv_cache import KVPool
from ktlite.runtime.loader import CheckpointReader, load_weights
from ktlite.runtime.memory import MemoryPlan, make_plan
from ktlite.runtime.model_runner import ModelRunner
from ktlite.runtime.state_cache import StatePool
from ktlite.runtime.models import serving_config
from ktlite.runtime.plan_inputs import plan_inputs

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    runner: ModelRunner
    plan: MemoryPlan
    cpu_moe: CPUMoE | None  # None on tensor-parallel ranks other than 0 (rank 0 runs the CPU experts)
    moe_layers: dict[int, HybridMoE]
    context_length: int
    vocab_size: int
    stats: ExpertStats | None = None
    dynamic: DynamicPlacement | None = None
    record_path: str | None = None

    @property
    def supports_prefix_cache(self) -> bool:
        """False for families with per-request recurrent state (which a token prefix cannot restore) unless the
        state pool keeps snapshots of it (runtime/state_cache.py)."""
        return self.runner.model.supports_prefix_cache or self.snapshot_pool is not None

    @property
    def snapshot_pool(self) -> StatePool | None:
        """The state pool when it keeps recurrent-state snapshots for the prefix cache (never under tensor
        parallelism, whose driver holds no pool here)."""
        states = getattr(self.runner, "state_pool", None)
        return states if states is not None and states.snapshot_rows else None

    def placement(self) -> dict[int, list[int]]:
        return {l: sorted(m.gpu_experts) for l, m in self.moe_layers.items()}

    def after_step(self) -> None:
        """Called by the scheduler after every forward step (on its thread, between steps)."""
        if self.dynamic is not None:
            for layer, (bring, evict) in self.dynamic.step(self.placement()).items():
                self.moe_layers[layer].move(bring, evict)

    def close(self) -> None:
        if self.stats is not None and self.record_path:
            self.stats.save(self.record_path)
            logger.info("expert distribution written to %s", self.record_path)
        if self.cpu_moe is not None:
            self.cpu_moe.close()


def assemble(config: EngineConfig, progress: bool = True, tp=None) -> Runtime:
    """The runtime of one process; `tp` (a tp_layers.TPContext) makes it one tensor-parallel rank's
    shard (see ktlite/runtime/parallel.py): sliced weights, its share of the GPU experts, and the
    CPU experts only on rank 0."""
    cfg = serving_config(config)  # with the MTP layer for NEXTN drafts
    config, _ = choose_knobs(config, cfg)  # a config the Engine already resolved comes back unchanged
    device, dtype = config.torch_device, config.torch_dtype
    rank = tp.rank if tp is not None else 0
    plan = make_plan(cfg, plan_inputs(config, cfg))  # raises PlanError before anything is allocated
    if rank == 0:
        logger.info("memory plan:\n%s", plan.format_table())
        if cfg.vision_skipped:
            logger.info("vision-language checkpoint: ktlite serves its language model only; the vision tower and "
                        "projector are not loaded, and requests with images are refused")
    alloc = functools.partial(plan.alloc, rank=rank)

    reader = CheckpointReader(config.model_path)
    model = models.build(cfg, device, dtype, routed_experts=False,
                         fp8_weights=config.keeps_fp8(cfg.fp8_block_size is not None), tp=tp)
    load_weights(model, reader, progress=progress, shards=getattr(model, "tp_shards", None))
    apply_cpu_dense(model, config)  # CPU device: quantize the linear layers per --cpu-dense-method
    experts = open_source(config, cfg)  # --kt-method and --kt-weight-path pick it (expert_sources.py)
    source = experts.dense

    per_layer = plan.gpu_experts_total  # the plan resolved --kt-gpu-experts-ratio vs --kt-num-gpu-experts
    stats = ExpertStats.load(config.init_expert_location, cfg.n_routed_experts) if config.init_expert_location else None
    placement = initial_placement(cfg.moe_layers, cfg.n_routed_experts, per_layer,
                                  config.kt_expert_placement_strategy, stats=stats, seed=config.seed)

    # the exact reference setting (fp32, no int8 activations: --dtype float32) keeps the CPU prefill GEMMs fp32 too;
    # else the CPU's fast dtype (bf16 where it beats fp32: int8 activations already round far more than bf16 does;
    # on a Zen 5 the 7 MoE layers of a V2-Lite-shaped 512-token prefill took 2.2-2.4 s in fp32, 0.9-1.2 s in bf16)
    prefill_dtype = torch.float32 if dtype == torch.float32 and not config.cpu_int8_activations else None
    # one copy of the CPU experts in RAM: only rank 0 holds them (and computes them for all ranks)
    cpu = CPUMoE(config.kt_method, config.kt_group_size, config.cpu_threads, config.kt_threadpool_count,
                 prefill_dtype=prefill_dtype, activations="int8" if config.cpu_int8_activations else "fp32"
                 ) if rank == 0 else None
    with contextlib.ExitStack() as on_failure:  # a failed load must not leave the CPU pools running
        if cpu is not None:
            on_failure.callback(cpu.close)
            experts.fill(cpu, placement, progress)
            cpu.warmup()
            for line in cpu.numa_report():  # where each pool runs and keeps its experts (ktlite/numa.py)
                logger.info(line)
            if device.type == "cpu" and len({n for p in cpu.pools.placements for n in p.nodes}) > 1:
                logger.info("CPU device: the experts run on the forward thread with every pool's threads "
                            "(CPUMoE.forward), which are not pinned to the pools' nodes; their pages are placed as above")

        observers = []
        record = ExpertStats(cfg.n_routed_experts) if config.record_expert_distribution and rank == 0 else None
        if record is not None:
            observers.append(record.record)
        dynamic = None
        if config.kt_enable_dynamic_expert_update and per_layer:
            dynamic = DynamicPlacement(config.kt_expert_update_interval, cfg.n_routed_experts)
            observers.append(dynamic.observe)

        h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        layerwise = None
        if config.kt_gpu_prefill_token_threshold is not None:
            layerwise = (alloc("layerwise_buffer", (e, 2 * i, h), dtype, device),
                         alloc("layerwise_buffer", (e, h, i), dtype, device))
        moe_layers = {}
        for l in cfg.moe_layers:
            # expert parallel: rank r holds every tp-th of the layer's GPU experts (the plan's count)
            mine = placement[l] if tp is None else placement[l][rank::tp.size]
            others = [x for x in placement[l] if x not in mine]
            n = len(mine)
            w13, w2 = alloc_gpu_experts(alloc, n, h, i, dtype, device, plan.inputs.gpu_expert_format)  # as planned
            mlp = model.layer(l).mlp
            moe_layers[l] = HybridMoE(l, mlp.gate, mlp.shared_experts, mine, w13, w2, cpu, source,
                                      config.kt_gpu_prefill_token_threshold, layerwise, observers,
                                      remote_gpu_experts=others, packed_source=experts.gpu_weights,
                                      activation=mlp.activation, biases=mlp.expert_biases())

        context = plan.context_length
        # what the family caches per token on this rank (a full MLA latent, or this rank's kv heads), in the
        # layout of the KV dtype (an FP8 pool packs MLA latents with their scales)
        specs = cfg.token_cache_specs(tp.size if tp is not None else 1, config.torch_kv_dtype)
        pool = KVPool(specs, plan.kv_pool_tokens, config.max_running_requests, context, config.torch_kv_dtype,
                      device, alloc=alloc)
        # recurrent layers' per-request state, at the request's KV-pool row
        recurrent = bool(cfg.request_state_specs())
        states = StatePool(cfg.request_state_specs(tp.size if tp is not None else 1), config.max_running_requests,
                           device, alloc=alloc, snapshots=config.state_snapshots(cfg.snapshot_state),
                           verify_rows=config.state_verify_rows(recurrent))
        runner = ModelRunner(model, pool, moe_layers, config.kt_max_deferred_experts_per_token, tp=tp,
                             state_pool=states)
        if config.kt_max_deferred_experts_per_token:
            logger.info("--kt-max-deferred-experts-per-token %d: outputs change slightly (deferred experts "
                        "join one layer later)", config.kt_max_deferred_experts_per_token)
        if cpu is not None:
            logger.info("ready: %d KV tokens, %d GPU experts per MoE layer, CPU experts %.2f GiB (%s)",
                        plan.kv_pool_tokens, per_layer, cpu.nbytes() / 2**30, cpu.method)
        on_failure.pop_all()
        return Runtime(runner, plan, cpu, moe_layers, context, cfg.vocab_size, stats=record, dynamic=dynamic,
                       record_path=config.record_expert_distribution)

