"""NEXTN (MTP) speculative drafts on a tiny DeepSeek-V3 written by transformers, with an MTP layer the fixture adds
under the hub's names (transformers' DeepseekV3 has none; HUB_MTP: each family's layout, test_mtp_families.py serves
the others): the greedy output equals plain decoding's in batches, chunked prefill and preemption; sampling keeps
working; a layer trained to predict the token after next is accepted far more often than a random one; the plan
counts the layer's weights and KV; checkpoints and families without one are refused.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_checkpoints import one_torch_thread, write_hf_checkpoint
from safetensors.torch import load_file, save_file

from ktlite import Engine
from ktlite.errors import ConfigError
from ktlite.runtime.models import build, load, load_config
from ktlite.runtime.models.base import LocalContext, PoolCache
from ktlite.runtime.memory import make_plan
from ktlite.runtime.plan_components import allocated_by_component
from ktlite.runtime.plan_inputs import PlanInputs
from ktlite.runtime.tiny_model import write_tiny_model
from ktlite.server.metrics import Metrics

EXACT = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 512,
         "gpu_memory": "1GiB"}
NEXTN = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}
NEW = 24  # greedy tokens per request
GREEDY = {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True}
TRAIN_STEPS = 80  # the loss is ~0.01 by 60 (a random layer's: ~ln(vocab) = 6.9 or more)


def prompts(vocab: int, n: int = 6, length: int = 8, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n, length), generator=g).tolist()


@dataclass(frozen=True)
class HubMTP:
    """How a family's hub checkpoints store the MTP layer (the names SGLang's loaders read: deepseek_nextn.py,
    glm4_moe_nextn.py, qwen3_next_mtp.py / qwen3_5_mtp.py), written here from the hub's convention, not ktlite's."""

    config_field: str  # config.json's count of MTP layers
    layer: str  # the prefix of its decoder layer's tensors; {n}: num_hidden_layers
    glue: tuple[str, str, str, str]  # eh_proj [hidden, 2 hidden], enorm, hnorm and its final norm; {n} as in layer
    copies: bool  # its own copies of the embeddings and the head beside it (the DeepSeek-V3 layout)
    like: int  # a decoder layer of the kind it is (MoE, full attention): its tensors' names and shapes


DEEPSEEK_LAYOUT = dict(config_field="num_nextn_predict_layers", layer="model.layers.{n}.", copies=True,
                       glue=tuple(f"model.layers.{{n}}.{name}.weight" for name in ("eh_proj", "enorm", "hnorm",
                                                                                   "shared_head.norm")))
QWEN_LAYOUT = dict(config_field="mtp_num_hidden_layers", layer="mtp.layers.0.", copies=False,
                   glue=("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                         "mtp.norm.weight"))
HUB_MTP = {
    "deepseek_v3": HubMTP(**DEEPSEEK_LAYOUT, like=2),
    "glm4_moe": HubMTP(**DEEPSEEK_LAYOUT, like=2),
    "glm_moe_dsa": HubMTP(**DEEPSEEK_LAYOUT, like=1),  # layer 1 runs its own indexer (2 reuses 1's)
    "qwen3_next": HubMTP(**QWEN_LAYOUT, like=3),  # the full-attention layer
    "qwen3_5_moe": HubMTP(**QWEN_LAYOUT, like=2),
}


def with_random_mtp_layer(src: Path, dst: Path, family: str, seed: int) -> Path:
    """A copy of checkpoint src (transformers' tiny `family`, which has no MTP layer; a text model or one in its
    vision-language wrapper) with one under the hub's names: its decoder layer a like layer's tensors with their
    values shuffled, its glue random."""
    hub, gen = HUB_MTP[family], torch.Generator().manual_seed(seed)
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    text_config = config.get("text_config", config)  # the VL wrapper nests the language model's
    text = "model.language_model." if "model.language_model.embed_tokens.weight" in tensors else "model."
    n = text_config["num_hidden_layers"]
    layer, like = hub.layer.format(n=n), f"{text}layers.{hub.like}."

    def shuffled(t: torch.Tensor) -> torch.Tensor:
        return t.flatten()[torch.randperm(t.numel(), generator=gen)].view_as(t).clone()

    mtp = {layer + k.removeprefix(like): shuffled(v) for k, v in tensors.items() if k.startswith(like)}
    hidden, spread = text_config["hidden_size"], tensors[like + "self_attn.o_proj.weight"].float().std()
    eh_proj, *norms = (name.format(n=n) for name in hub.glue)
    mtp[eh_proj] = (torch.randn(hidden, 2 * hidden, generator=gen) * spread).bfloat16()
    mtp.update({name: shuffled(tensors[f"{text}norm.weight"]) for name in norms})
    if hub.copies:
        mtp[layer + "embed_tokens.weight"] = tensors[f"{text}embed_tokens.weight"].clone()
        mtp[layer + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **mtp}, dst / "model.safetensors", metadata={"format": "pt"})
    text_config[hub.config_field] = 1
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def with_mtp_tensors(src: Path, dst: Path, mtp: dict[str, torch.Tensor]) -> Path:
    """A copy of checkpoint src (with an MTP layer) with the MTP tensors `mtp` (checkpoint names) replaced; each
    must be one src has (ktlite's names map to the hub's)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    assert set(mtp) <= set(tensors), sorted(set(mtp) - set(tensors))
    tensors.update({k: v.to(torch.bfloat16).contiguous() for k, v in mtp.items()})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def mtp_tensors(model) -> dict[str, torch.Tensor]:
    return {model.checkpoint_name(f"mtp.{k}"): v.detach().clone() for k, v in model.mtp.state_dict().items()}


def target_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The target's final-normed hidden states [B, T, hidden] of sequences ids [B, T] (what the engine gives MTP)."""
    cache = PoolCache(model, *ids.shape)
    batch = cache.batch(ids)
    batch.capture_hidden = True
    with torch.inference_mode():
        model.forward_batch(batch, LocalContext(cache.pool, cache.states))
        hidden = model.model.norm(batch.hidden_states)
    return hidden.clone().view(*ids.shape, -1)  # out of inference mode: usable as a constant in autograd


def train_mtp(model, seqs: torch.Tensor, steps: int) -> float:
    """Train model.mtp (enorm, hnorm, eh_proj and its decoder layer) on sequences [B, T] to predict token t + 2 from
    the target's state at t and token t + 1; -> the last loss."""
    torch.manual_seed(0)
    hidden = target_hidden(model, seqs)[:, :-1]
    with torch.no_grad():
        embedded = model.model.embed_tokens(seqs[:, 1:])
    positions = torch.arange(seqs.shape[1] - 1).expand(seqs.shape[0], -1)
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-2)
    with one_torch_thread():
        for _ in range(steps):
            logits = model.lm_head(model.mtp(embedded, hidden, positions)[:, :-1])  # the last row has no token t + 2
            loss = F.cross_entropy(logits.flatten(0, 1), seqs[:, 2:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return loss.item()


@pytest.fixture(scope="module")
def mtp_checkpoints(tmp_path_factory) -> dict[str, Path]:
    return write_mtp_checkpoints(tmp_path_factory.mktemp("mtp"), "deepseek_v3")


def write_mtp_checkpoints(root: Path, family: str, steps: int = TRAIN_STEPS) -> dict[str, Path]:
    """{"random": `family`'s tiny checkpoint with a random MTP layer, "trained": it trained (`steps` steps) on the
    model's own greedy continuations of the prompts the tests serve}."""
    base = write_hf_checkpoint(root / "base", family, seed=5)
    random = with_random_mtp_layer(base, root / "random", family, seed=6)
    model = load(random, mtp=True)  # bf16-rounded as stored
    batch = torch.tensor(prompts(model.config.vocab_size))
    with one_torch_thread():
        seqs = torch.cat([batch, model.generate_greedy(batch, NEW + 8)], dim=1)
    loss = train_mtp(model, seqs, steps)
    assert loss < 0.5, loss  # it learned the continuations
    return {"random": random, "trained": with_mtp_tensors(random, root / "trained", mtp_tensors(model))}


def generate(path: Path, batch: list[list[int]], params: dict, **flags) -> tuple[list, Engine]:
    with Engine(str(path), **{**EXACT, **flags}) as eng:
        results = eng.generate(input_ids=batch, sampling_params=params)
        if flags.get("speculative_algorithm"):
            pool = eng.runtime.runner.kv_pool
            assert pool.free_tokens == pool.num_slots  # rejected drafts' and the chain's borrowed slots came back
    return results, eng


def tokens(results) -> list[tuple[list[int], str]]:
    return [(r.token_ids, r.finish_reason) for r in results]


@pytest.mark.parametrize("flags", [
    {},
    {"chunked_prefill_size": 5, "enable_mixed_chunk": True},
    {"max_total_tokens": 48, "chunked_prefill_size": 16},
])
def test_nextn_greedy_output_equals_plain_decoding(mtp_checkpoints, flags):
    path = mtp_checkpoints["trained"]
    batch = prompts(1024)
    want, _ = generate(path, batch, GREEDY, **flags)
    got, eng = generate(path, batch, GREEDY, **NEXTN, **flags)
    assert tokens(got) == tokens(want)
    sched = eng.scheduler
    assert sched.drafted_tokens > 0 and sched.accepted_tokens > 0
    if "max_total_tokens" in flags:
        assert sched.preemptions > 0


def test_requests_that_do_not_draft_share_the_batch(mtp_checkpoints):
    """A logprobs request (no drafter: no MTP rows) and one whose min_tokens hold its drafts back for a while (its MTP
    KV still built) decode beside drafting ones, each as plain decoding does."""
    batch = prompts(1024)[:4]
    asks = [(batch[0], GREEDY), (batch[1], {**GREEDY, "logprobs": True}), (batch[2], {**GREEDY, "min_tokens": 12}),
            (batch[3], GREEDY)]

    def together(eng: Engine) -> list:
        async def all_at_once():
            return await asyncio.gather(*(eng.async_generate(input_ids=p, sampling_params=s) for p, s in asks))

        return asyncio.run(all_at_once())

    with Engine(str(mtp_checkpoints["trained"]), **EXACT) as eng:
        want = together(eng)
    with Engine(str(mtp_checkpoints["trained"]), **EXACT, **NEXTN) as eng:
        got = together(eng)
        assert eng.scheduler.accepted_tokens > 0
    assert tokens(got) == tokens(want)


@pytest.mark.parametrize("steps, trained_above", [(1, 0.8), (3, 0.4)])
def test_a_trained_mtp_layer_is_accepted_and_a_random_one_is_not(mtp_checkpoints, steps, trained_above):
    """The layer was trained at depth 1 (measured: trained 1.0, random 0.0); a chain's later steps read the layer's
    own output, which it was not trained on (3 drafts a step, measured: trained 0.58, random 0.0)."""
    batch = prompts(1024)
    rates = {}
    for name in ("random", "trained"):
        with Engine(str(mtp_checkpoints[name]), **EXACT, speculative_algorithm="EAGLE",
                    speculative_num_steps=steps) as eng:
            eng.generate(input_ids=batch, sampling_params=GREEDY)
            sched = eng.scheduler
            page = Metrics("tiny").render(eng)
        assert f"ktlite_spec_draft_tokens_total {sched.drafted_tokens}" in page
        assert f"ktlite_spec_accepted_tokens_total {sched.accepted_tokens}" in page
        rates[name] = sched.accepted_tokens / sched.drafted_tokens
    assert rates["trained"] > trained_above and rates["random"] < 0.1, rates


def reference_drafts(model, seq: list[int], length: int, drafts: list[int]) -> list[torch.Tensor]:
    """The plain torch MTP layer's logits [vocab] for each of the drafts proposed after seq[:length]: the first from
    the target's states over the sequence, each next one from the layer's own output and the previous draft fed in
    at the next position (the engine's drafts as inputs, so a near-tie does not derail the comparison)."""
    ids = torch.tensor([seq[:length]])
    hidden = target_hidden(model, ids)[0, :-1]  # the states at positions 0 .. length - 2
    tokens = seq[1:length]  # the token after each of them
    out = []
    with torch.no_grad():
        for d in drafts:
            n = len(tokens)
            normed = model.mtp(model.model.embed_tokens(torch.tensor([tokens])), hidden[None], torch.arange(n)[None])[0]
            out.append(model.lm_head(normed[-1]))
            hidden, tokens = torch.cat([hidden, normed[-1:]]), tokens + [d]
    return out


def test_drafts_are_the_plain_torch_mtp_layers_predictions(mtp_checkpoints):
    """Every chain of drafts the engine proposes (chunked prefill of 5, so the layer's KV is built over chunks) is
    the argmax of the plain torch layer run over whole sequences (within float error of its max)."""
    assert_drafts_are_the_plain_torch_predictions(mtp_checkpoints["random"])


def assert_drafts_are_the_plain_torch_predictions(path: Path) -> None:
    batch = prompts(1024)[:2]
    proposed: list[tuple[int, int, list[int]]] = []  # (request, sequence length, drafts)
    with Engine(str(path), **{**EXACT, "chunked_prefill_size": 5}, **NEXTN) as eng:
        sched, add = eng.scheduler, eng.scheduler.add

        def spy_add(rid, prompt_ids, params):
            queue = add(rid, prompt_ids, params)
            req = sched.waiting[-1]
            drafter, propose = req.drafter, req.drafter.propose

            def spy(new_tokens, k):
                drafts = propose(new_tokens, k)
                if drafts:
                    proposed.append((batch.index(prompt_ids), drafter.seen, drafts))
                return drafts

            drafter.propose = spy
            return queue

        sched.add = spy_add
        results = eng.generate(input_ids=batch, sampling_params=GREEDY)
    assert len(proposed) > 10 and max(len(d) for _, _, d in proposed) == NEXTN["speculative_num_steps"]
    model = load(path, mtp=True)
    with one_torch_thread():
        for i, length, drafts in proposed[::4]:
            seq = batch[i] + results[i].token_ids
            for d, logits in zip(drafts, reference_drafts(model, seq, length, drafts)):
                assert logits[d] >= logits.max() - 1e-3 * logits.abs().max()


def test_sampling_with_nextn_drafts_is_reproducible(mtp_checkpoints):
    path = mtp_checkpoints["trained"]
    # the tiny model's top logits are close: even this cool, sampling soon leaves the greedy continuations the layer
    # learned, so few drafts are accepted (measured: 5 of 174), but some are, through the rejection-sampling path
    params = {"temperature": 0.05, "top_p": 0.9, "max_tokens": NEW, "ignore_eos": True, "seed": 3}
    batch = prompts(1024)[:3]
    first, eng = generate(path, batch, params, **NEXTN)
    again, _ = generate(path, batch, params, **NEXTN)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert all(r.completion_tokens == NEW for r in first) and eng.scheduler.accepted_tokens > 0


def test_nextn_drafts_compile_nothing_after_start_up(mtp_checkpoints):
    """The MTP layer's extends and chain steps are among the paths warmed at start-up (the demo's flags: quantized
    CPU dense layers, so its attention takes the compiled decode block)."""
    assert_drafts_compile_nothing_after_start_up(mtp_checkpoints["trained"])


def assert_drafts_compile_nothing_after_start_up(path: Path) -> None:
    from test_warm_start import FLAGS, specialisations

    with Engine(str(path), **FLAGS, **NEXTN) as eng:
        before = specialisations()
        eng.generate(input_ids=prompts(1024)[:3] + [[9]], sampling_params={**GREEDY, "max_tokens": 8})
        after = specialisations()
        assert eng.scheduler.drafted_tokens > 0
    grown = {name: (before.get(name, 0), n) for name, n in after.items() if n != before.get(name, 0)}
    assert grown == {}, f"compiled or loaded during the requests: {grown}"


def test_the_plan_counts_the_mtp_layer(mtp_checkpoints):
    with Engine(str(mtp_checkpoints["random"]), **EXACT, **NEXTN, kt_num_gpu_experts=4) as eng:
        plan, model = eng.runtime.plan, eng.runtime.runner.model
        assert sorted(eng.runtime.moe_layers) == [1, 2, 3]  # the MTP layer's experts: 4 on the GPU, 12 on the CPU
        assert len(eng.runtime.placement()[3]) == 4
        allocated = allocated_by_component(model)
        allocated.update(plan.allocated())
        layers = eng.runtime.runner.kv_pool.buffers["latent"].shape[0]
    assert allocated["mtp"] > 0 and allocated["gpu_experts"] > 0 and plan.mismatches(allocated) == {}
    cfg = model.config
    assert layers == cfg.num_hidden_layers + 1  # the MTP layer's latents beside the decoder's
    assert plan.kv_bytes_per_token == layers * cfg.kv_latent_dim * 4


def test_deepseek_v3_plan_with_its_mtp_layer():
    """The hub config (61 layers + 1 MTP layer): one more latent per token; the layer's attention, shared expert and
    eh_proj on the device, its routed experts one more MoE layer's (GPU experts per layer, the rest on the CPU)."""
    cfg = load_config(Path(__file__).parent / "data" / "deepseek-v3")
    inputs = PlanInputs(gpu_memory="640GiB", dtype="bfloat16", kt_num_gpu_experts=2,
                        max_total_tokens=8192)
    plain, mtp = make_plan(cfg, inputs), make_plan(cfg.with_mtp(), inputs)
    assert plain.bytes("mtp") == 0 and plain.kv_bytes_per_token == 61 * (512 + 64) * 2
    assert mtp.kv_bytes_per_token == 62 * (512 + 64) * 2
    expert = 3 * 7168 * 2048 * 2  # bf16
    assert (plain.bytes("gpu_experts"), mtp.bytes("gpu_experts")) == (58 * 2 * expert, 59 * 2 * expert)
    # attention, shared expert, eh_proj (its norms count as norms)
    assert mtp.bytes("mtp") == mtp.bytes("attention") // 61 + expert + 2 * 7168 * 7168 * 2
    assert {c: mtp.bytes(c) for c in ("attention", "shared_experts", "embeddings", "lm_head")} == {
        c: plain.bytes(c) for c in ("attention", "shared_experts", "embeddings", "lm_head")}


def test_a_block_fp8_checkpoint_keeps_eh_proj_in_high_precision():
    """DeepSeek-V3's FP8 checkpoint stores the MTP layer's attention and experts in FP8, eh_proj in bf16."""
    cfg = load_config(Path(__file__).parent / "data" / "deepseek-v3").with_mtp()
    model = build(cfg, "meta", torch.bfloat16, routed_experts=False, fp8_weights=True)
    assert type(model.mtp.eh_proj) is torch.nn.Linear and model.mtp.eh_proj.weight.dtype == torch.bfloat16
    assert model.mtp.self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    assert model.mtp.mlp.shared_experts.down_proj.weight.dtype == torch.float8_e4m3fn


def test_checkpoints_and_families_without_an_mtp_layer_are_refused(mtp_checkpoints, tmp_path):
    none = tmp_path / "none"
    shutil.copytree(mtp_checkpoints["random"], none)
    config = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match="--speculative-algorithm NEXTN.*num_nextn_predict_layers is 0"):
        Engine(str(none), **EXACT, speculative_algorithm="NEXTN")
    qwen3 = write_tiny_model(tmp_path / "qwen3", "qwen3_moe", seed=1)
    with pytest.raises(ConfigError, match="multi-token-prediction layers are not built for Qwen3MoeForCausalLM"):
        Engine(str(qwen3), **EXACT, speculative_algorithm="EAGLE")
