"""replace_norms' recipes as the papers wrote them and as a user's initialisation needs them (issue 97): the default
'auto' matches each gain on drawn token ids, 'dyt_paper' and 'derf_paper' are the papers' whole language-model
recipes (the embedding scale saved and reloaded), and the builders' ``norm_layer=``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normlab
from normlab.elementwise import DyT
from test_swap import ids, tiny_llama


def test_the_default_recipe_matches_each_gain_on_drawn_token_ids():
    """init 'auto' (the default): fresh layers at their own alpha0, then each gamma scaled so that the site's output
    has RMS 1 on a batch of random token ids the swap draws itself; the same factors as match_rms on that batch."""
    from normlab.recipes import token_sample

    model, twin = tiny_llama(width=64, layers=1), tiny_llama(width=64, layers=1)
    twin.load_state_dict(model.state_dict())
    record = normlab.replace_norms(model, "dyt")
    assert record.recipes == ["auto"] and all(s.notes[-1].startswith("auto: gamma x ") for s in record.sites)
    ids_, why = token_sample(twin)
    assert why is None and ids_.shape == (4, 32) and int(ids_.max()) < twin.config.vocab_size
    normlab.replace_norms(twin, "dyt", init=["default", "match_rms"], sample=ids_)
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), n
    norm = model.model.norm
    assert norm.alpha.item() == 0.5 and float(norm.weight.mean()) > 5  # gamma x ~30: a std-0.02 model is quiet


def test_the_default_recipe_without_a_sample_to_draw_keeps_the_own_init_and_says_so():
    """No token embedding (a ViT-like stack): nothing to draw, so the layers keep their own init, with a warning and
    the record's note naming sample=."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    with pytest.warns(RuntimeWarning, match="no token embedding.*pass sample="):
        record = normlab.replace_norms(model, "dyt")
    assert torch.equal(model[1].weight, torch.ones(8)) and "kept the layers' own init" in record.notes[-1]
    record = normlab.replace_norms(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), "dyt", sample=torch.randn(2, 8))
    assert record.sites[0].notes[-1].startswith("auto: gamma x ")


def test_the_dyt_paper_recipe_on_a_language_model_is_the_paper_s_whole_recipe(tmp_path):
    """The DyT paper's LLaMA: alpha0 by width and site, no bias, and the embedding multiplied by a learnable scalar
    initialised to sqrt(d); recorded, saved, and back through both loaders with the same logits. A std-0.02 model at
    width 64 embeds at RMS 0.16 after the scale, far from the paper's 1.28: the swap warns, naming the fix."""
    from transformers import AutoModelForCausalLM

    from normlab.embed_scale import ScaledEmbedding, fold_embed_scale

    model = tiny_llama(width=64, layers=1)
    head = model.lm_head.weight
    with pytest.warns(RuntimeWarning, match="init='auto'"):
        record = normlab.replace_norms(model, "dyt", init="dyt_paper")
    emb = model.model.embed_tokens
    assert isinstance(emb, ScaledEmbedding) and emb.scale.item() == pytest.approx(8.0) and emb.scale.requires_grad
    assert record.embed_scale == ["model.embed_tokens"] and model.lm_head.weight is head
    assert all(model.get_submodule(s.name).bias is None for s in record.sites)
    batch = ids(2, 12)
    with torch.no_grad():
        emb.scale.fill_(5.0)  # as if trained
        want = model(batch).logits
    normlab.save_converted(model, record, tmp_path / "m")
    back, rec = normlab.load_converted(tmp_path / "m")
    alone = AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True)
    with torch.no_grad():
        torch.testing.assert_close(back(batch).logits, want, rtol=0, atol=0)
        torch.testing.assert_close(alone(batch).logits, want, rtol=1e-5, atol=1e-5)
    assert rec.embed_scale == ["model.embed_tokens"] and float(alone.model.embed_tokens.scale) == 5.0
    assert fold_embed_scale(model) == ["model.embed_tokens"] and type(model.model.embed_tokens) is nn.Embedding
    with torch.no_grad():
        torch.testing.assert_close(model(batch).logits, want, rtol=1e-5, atol=1e-5)


def test_the_derf_paper_recipe_on_gpt2_scales_token_and_position_tables_and_keeps_the_bias():
    """The Derf paper's GPT-2 patch: alpha0 1.0 at every site, shift0 0, the bias kept, token plus position
    embeddings scaled by sqrt(d); a model without a token embedding gets the vision init and a note."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=1, n_head=2, n_positions=32))
    with pytest.warns(RuntimeWarning, match="derf_paper"):
        record = normlab.replace_norms(model, "derf", init="derf_paper")
    assert record.embed_scale == ["transformer.wte", "transformer.wpe"]
    assert all(model.get_submodule(s.name).alpha.item() == 1.0 for s in record.sites)
    assert all(model.get_submodule(s.name).bias is not None for s in record.sites)
    vit = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    record = normlab.replace_norms(vit, "derf", init="derf_paper")
    assert vit[1].alpha.item() == 0.5 and not record.embed_scale and "no token embedding" in record.notes[1]


def test_norm_layer_builds_what_a_model_builder_asks_for():
    """``norm_layer=`` for timm and torchvision builders: channels and eps as they pass them, the layer's own keywords,
    axis 1 for channels-first maps; a builder asking for a norm without parameters is refused."""
    make = normlab.norm_layer("dyt", alpha_init=0.8)
    m = make(16, eps=1e-6, device="cpu")
    assert isinstance(m, DyT) and m.alpha.item() == pytest.approx(0.8) and m.weight.shape == (16,)
    assert normlab.norm_layer("rms_norm")(16, eps=1e-3).eps == 1e-3
    first = normlab.norm_layer("dyt", channels_first=True)(8)
    assert first(torch.randn(2, 8, 3, 3)).shape == (2, 8, 3, 3) and first.channel_dim == 1
    with pytest.raises(ValueError, match="without parameters"):
        make(16, affine=False)


def test_a_module_named_norm_that_holds_a_norm_is_not_an_unknown_norm():
    """timm's NormMlpClassifierHead holds a LayerNorm2d: the head is a container, its norm is found inside."""

    class NormMlpHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 2)

        def forward(self, x):
            return self.fc(self.norm(x))

    model = nn.Sequential(nn.Linear(8, 8), NormMlpHead())
    record = normlab.replace_norms(model, "dyt", init="default")
    assert [s.name for s in record.sites] == ["1.norm"] and not record.skipped


def test_a_scaled_embedding_sharded_by_rows_says_what_to_do():
    """Under RowwiseParallel the table's output is a masked partial sum that DTensor cannot scale (an AssertionError
    deep in DTensor on 2 ranks, seen under torchrun); the layer says so, with the two ways out."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from normlab.embed_scale import ScaledEmbedding

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(ScaledEmbedding(16, 8, scale_init=2.0))
        plan = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": plan})
        with pytest.raises(ValueError, match="sharded by rows.*init='default'"):
            model(torch.randint(0, 16, (2, 4)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("to, recipe, block", [
    ("dyt", "dyt_paper", "llama"), ("derf", "derf_paper", "gpt2"), ("dyisru", "dyt_paper", "gpt2"),
])  # fmt: skip
def test_a_lab_model_and_a_library_swap_with_the_same_recipe_start_the_same(to, recipe, block):
    """issue 97: the lab's ``model.recipe`` and ``replace_norms(init=...)`` read one recipe table: a lab GPT built
    with a recipe and the same GPT built with RMSNorm, then swapped by the library with that recipe, hold the same
    norm parameters at every site and the same embedding scalar, and compute the same logits. Width 2048, where the
    DyT paper's row has two values (1.0 before attention, 0.5 elsewhere)."""
    from normlab.embed_scale import ScaledEmbedding
    from normlab.lab import GPT, GPTConfig

    shape = dict(width=2048, depth=1, heads=16, context=8, vocab_size=32, mlp_ratio=1.0, block=block)
    torch.manual_seed(0)
    lab = GPT(GPTConfig(**shape, norm=to, recipe=recipe))
    torch.manual_seed(0)
    swapped = GPT(GPTConfig(**shape, norm="rms_norm"))
    normlab.replace_norms(swapped, to, init=recipe)
    for site in ("blocks.0.norm_attn", "blocks.0.norm_mlp", "norm_final"):
        got, want = swapped.get_submodule(site).state_dict(), lab.get_submodule(site).state_dict()
        assert got.keys() == want.keys(), site  # DyT under dyt_paper: no bias in either
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=f"{site}.{k}")
    scales = [float(m.scale.detach()) for m in swapped.modules() if isinstance(m, ScaledEmbedding)]
    assert scales == [float(lab.embed_scale.detach())] * (2 if block == "gpt2" else 1)  # tokens (and positions)
    assert scales[0] == pytest.approx(2048**0.5)
    idx = torch.randint(32, (2, 8))
    with torch.no_grad():  # one scalar on tokens + positions against one on each: the same sum, rounded apart
        want = lab(idx)[0]
        torch.testing.assert_close(swapped(idx)[0], want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    key = "beta" if to == "dyisru" else "alpha"
    first, second = (float(getattr(lab.blocks[0].get_submodule(s), key).detach()) for s in ("norm_attn", "norm_mlp"))
    assert first != second or to == "derf"  # the row's two values reached the sites (Derf's LM recipe: 1.0 at all)


def test_q_and_k_norms_have_their_role_and_keep_their_own_init_under_the_paper_recipe():
    """Qwen3's q/k norms (per head, inside attention) are role "qk": "dyt_paper" gives them DyT's own alpha0 and
    says the paper has no value for them (it raised before, asking for roles=), while the block norms get the
    paper's; ``roles=`` still chooses another role for them."""
    from conftest import tiny_lm
    from normlab.recipes import QK_NOTE, dyt_alpha0, site_role

    assert site_role("model.layers.0.self_attn.q_norm") == "qk" == site_role("blocks.3.attn.k_layernorm")
    model = tiny_lm("Qwen3")
    with pytest.warns(RuntimeWarning):  # a std-0.02 model embeds far below the paper's RMS: said, as for Llama
        record = normlab.replace_norms(model, "dyt", init="dyt_paper")
    by_role = {}
    for s in record.sites:
        by_role.setdefault(s.notes[0], []).append(s)
    assert sorted(by_role) == ["role attn", "role final", "role mlp", "role qk"] and len(by_role["role qk"]) == 4
    table = dyt_alpha0(32)
    for s in by_role["role qk"]:
        assert float(model.get_submodule(s.name).alpha.detach()) == 0.5 and QK_NOTE in s.notes[1]
    for s in by_role["role attn"]:
        assert float(model.get_submodule(s.name).alpha.detach()) == pytest.approx(table["attn"])
    again = tiny_lm("Qwen3")
    with pytest.warns(RuntimeWarning):
        record = normlab.replace_norms(again, "dyt", init="dyt_paper", roles={"*_norm": "attn", "*q_norm": "attn"})
    q = next(s for s in record.sites if s.name.endswith("q_norm"))
    assert q.notes[0] == "role attn" and float(again.get_submodule(q.name).alpha.detach()) == pytest.approx(
        table["attn"]
    )
