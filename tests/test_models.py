"""Models: LRA classifiers, the two-tower matcher and the causal LM with any attention."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernelstudy as ks
from kernelstudy.feature_maps import FeatureMap, Hyperparameter

from .conftest import compiled_whole, outputs_and_grads, rel_err

ATTENTIONS = ["softmax", "elu"]
SMALL = {"d_model": 16, "n_heads": 2, "n_layers": 2, "d_ff": 32, "dropout": 0.0}


pytestmark = pytest.mark.usefixtures("one_thread")


class SoftplusLinearMap(FeatureMap):
    """A trainable test map φ(x) = softplus(x W) with the penalty ‖WᵀW − I‖², F = num_features."""

    name = "tests.test_models:SoftplusLinearMap"
    trainable = True
    hyperparameters = {"num_features": Hyperparameter(int, 6, low=1)}

    def __init__(self, head_dim: int, num_heads: int = 1, **hparams) -> None:
        super().__init__(head_dim, num_heads, **hparams)
        self.weight = nn.Parameter(torch.randn(head_dim, self.feature_dim) / head_dim**0.5)

    @property
    def feature_dim(self) -> int:
        return self.hparams["num_features"]

    def features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return F.softplus(x @ self.weight)

    def regularization(self) -> torch.Tensor:
        gram = self.weight.T @ self.weight
        return (gram - torch.eye(gram.shape[0])).square().sum()


TEST_MAP = {"name": SoftplusLinearMap.name, "num_features": 6}


def _ids(b: int, n: int, vocab: int = 20) -> torch.Tensor:
    return torch.randint(0, vocab, (b, n))


def _padded(lengths: list[int], n: int, vocab: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _ids(len(lengths), n, vocab)
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    return ids, mask


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_classifier_shapes_and_grads(attention, pooling, positions):
    model = ks.nn.SequenceClassifier(
        20, 3, attention=attention, pooling=pooling, positions=positions, max_len=12, **SMALL
    )
    ids, mask = _padded([12, 7, 1], 12)
    logits = model(ids, mask)
    assert logits.shape == (3, 3) and torch.isfinite(logits).all()
    assert model.encode(ids, mask).shape == (3, 16)
    logits.sum().backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    assert not unused
    assert model(ids).shape == (3, 3)  # no mask: every token is real


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_classifier_ignores_padding(attention, pooling):
    model = ks.nn.SequenceClassifier(20, 4, attention=attention, pooling=pooling, **SMALL).eval()
    ids, mask = _padded([9, 5], 9)
    pooled = model.encode(ids, mask)
    garbage = ids.clone()
    garbage[~mask] = torch.randint(0, 20, (int((~mask).sum()),))
    assert rel_err(model.encode(garbage, mask), pooled) <= 1e-5
    longer = torch.cat([ids, _ids(2, 6)], 1)  # more padding, more garbage
    longer_mask = torch.cat([mask, torch.zeros(2, 6, dtype=torch.bool)], 1)
    assert rel_err(model.encode(longer, longer_mask), pooled) <= 1e-5
    alone = model.encode(ids[1:, :5])  # the short sequence without any padding
    assert rel_err(pooled[1:], alone) <= 1e-5


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_matching_model_two_towers(attention):
    model = ks.nn.MatchingClassifier(20, attention=attention, **SMALL).eval()
    a, mask_a = _padded([8, 3], 8)
    b, mask_b = _padded([5, 8], 8)
    logits = model(a, mask_a, b, mask_b)
    assert logits.shape == (2, 2)
    assert model.head[0].in_features == 4 * 16
    # the shared tower: the joint pass equals encoding each document alone
    assert rel_err(model.encode(torch.cat([a, b]), torch.cat([mask_a, mask_b]))[:2],
                   model.encode(a, mask_a)) <= 1e-5  # fmt: skip
    # documents of different lengths take the two-pass path and give the same logits
    b_short, mask_b_short = b[:, :8].clone(), mask_b.clone()
    b_long = torch.cat([b_short, _ids(2, 4)], 1)
    mask_b_long = torch.cat([mask_b_short, torch.zeros(2, 4, dtype=torch.bool)], 1)
    assert rel_err(model(a, mask_a, b_long, mask_b_long), logits) <= 1e-5
    # swapping the documents swaps u and v: same shapes, u*v term unchanged
    swapped = model(b, mask_b, a, mask_a)
    assert swapped.shape == logits.shape
    with pytest.raises(ValueError, match="input_ids_2"):
        model(a, mask_a)
    with pytest.raises(ValueError, match="batch size"):
        model(a, mask_a, b[:1], mask_b[:1])


def test_matching_towers_share_one_draw_of_a_redrawing_map():
    """Documents of different lengths were encoded in two passes, and a map redrawing every
    query call gave the two towers different random features."""
    favor = {"name": "favor", "num_features": 8, "redraw_every": 1, "seed": 0}
    model = ks.nn.MatchingClassifier(20, feature_map=favor, **SMALL).train()
    a, mask_a = _padded([6, 4], 6)
    a_long = torch.cat([a, _ids(2, 3)], 1)  # the same document, 3 more padded positions
    mask_long = torch.cat([mask_a, torch.zeros(2, 3, dtype=torch.bool)], 1)
    u, v = [], []
    model.head = nn.Identity()  # the logits' input: [u, v, u*v, u-v]
    for _ in range(3):
        out = model(a, mask_a, a_long, mask_long)
        u.append(out[:, :16])
        v.append(out[:, 16:32])
    for x, y in zip(u, v, strict=True):
        assert rel_err(x, y) <= 1e-5  # one document, one draw: the same encoding
    assert rel_err(u[0], u[1]) > 1e-3  # and the draw did change between forwards


@pytest.mark.parametrize("kind", ["lm", "classifier", "cls_classifier"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_model_converted_to_another_dtype_runs(kind, dtype):
    """Sinusoidal positions were float32 and turned a .to(bfloat16) model's activations
    back to float32, which LayerNorm refused (the cls token's too)."""
    if kind == "lm":
        model = ks.nn.CausalLM(20, **SMALL)
    else:
        pooling = "cls" if kind == "cls_classifier" else "mean"
        model = ks.nn.SequenceClassifier(20, 3, pooling=pooling, **SMALL)
    assert model.to(dtype).eval()(_ids(2, 5)).dtype == dtype


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_token_ids_of_any_accepted_integer_dtype(dtype):
    """uint8 (bytes, pixels) and int16 ids passed the check, then failed in nn.Embedding;
    int8 was refused as "not an integer tensor"."""
    ids = _ids(2, 5)
    for model in (ks.nn.SequenceClassifier(20, 3, **SMALL), ks.nn.CausalLM(20, **SMALL)):
        model.eval()
        torch.testing.assert_close(model(ids.to(dtype)), model(ids))
    lm = ks.nn.CausalLM(20, **SMALL).eval()
    assert torch.equal(lm.generate(ids.to(dtype), 3), lm.generate(ids, 3))


def test_step_of_a_redrawing_map_needs_eval_mode():
    favor = {"name": "favor", "num_features": 8, "redraw_every": 2, "seed": 0}
    model = ks.nn.CausalLM(20, feature_map=favor, **SMALL).train()
    with pytest.raises(ValueError, match=r"needs eval mode \(layer.eval\(\)\)"):
        model.step(_ids(2, 1)[:, 0], None)
    model.eval().step(_ids(2, 1)[:, 0], None)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("tie_weights", [False, True])
def test_lm_step_equals_forward(attention, tie_weights):
    model = ks.nn.CausalLM(20, attention=attention, tie_weights=tie_weights, **SMALL).eval()
    ids = _ids(2, 9)
    full = model(ids)
    assert full.shape == (2, 9, 20)
    state = None
    for t in range(ids.shape[1]):
        logits, state = model.step(ids[:, t], state)
        assert rel_err(logits, full[:, t]) <= 1e-5
    assert state.position == 9
    kind = ks.RecurrentState if attention != "softmax" else ks.nn.KVCache
    assert all(isinstance(s, kind) for s in state.layers)
    if tie_weights:
        assert model.head.weight is model.embed.weight and model.head.bias is None


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_lm_blocks_equal_forward(attention):
    """A prompt read in one block, a second block from its state, then a step: the logits
    of the forward over all of it (1e-5), and the position counts every token."""
    model = ks.nn.CausalLM(20, attention=attention, **SMALL).eval()
    ids = _ids(2, 12)
    with torch.no_grad():
        full = model(ids)
        first, state = model.steps(ids[:, :7])
        second, state = model.steps(ids[:, 7:11], state)
        last, state = model.step(ids[:, 11], state)
    assert first.shape == (2, 7, 20) and state.position == 12
    assert rel_err(torch.cat([first, second, last[:, None]], 1), full) <= 1e-5
    with pytest.raises(TypeError, match="state must be None or the LMState"):
        model.steps(ids, state.layers)
    with pytest.raises(ValueError, match="tokens"):
        model.steps(ids.float())


def test_lm_step_equals_forward_with_separate_query_and_key_maps():
    """hedgehog with tie_qk=False: the RNN steps map keys with the keys' own weights, as the
    batch does (key features go through key_features, with its per-key shift)."""
    hedgehog = {"name": "hedgehog", "tie_qk": False}
    model = ks.nn.CausalLM(20, feature_map=hedgehog, **SMALL).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "key_" in name:
                p.add_(0.3 * torch.randn_like(p))
    ids = _ids(2, 9)
    full, state = model(ids), None
    for t in range(ids.shape[1]):
        logits, state = model.step(ids[:, t], state)
        assert rel_err(logits, full[:, t]) <= 1e-5


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_lm_is_causal_and_generates_greedily(attention):
    model = ks.nn.CausalLM(20, attention=attention, **SMALL).train()
    ids = _ids(2, 8)
    changed = ids.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 20
    model.eval()
    assert rel_err(model(changed)[:, :5], model(ids)[:, :5]) <= 1e-5
    model.train()
    out = model.generate(ids[:, :3], max_new_tokens=4)
    assert model.training  # mode restored
    assert out.shape == (2, 7) and torch.equal(out[:, :3], ids[:, :3])
    model.eval()
    seq = ids[:, :3]
    for _ in range(4):  # greedy rollout with full forwards
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)
    g = torch.Generator().manual_seed(0)
    sampled = model.generate(ids[:, :3], 4, temperature=1.0, generator=g)
    assert sampled.shape == (2, 7) and int(sampled.max()) < 20


def test_parameter_counts_and_feature_dim():
    soft = ks.nn.SequenceClassifier(20, 2, attention="softmax", **SMALL)
    assert soft.feature_dim is None and soft.feature_map_parameter_count() == 0
    assert soft.parameter_count() == sum(p.numel() for p in soft.parameters())
    elu = ks.nn.SequenceClassifier(20, 2, attention="elu", **SMALL)
    assert elu.feature_dim == 8 and elu.feature_map_parameter_count() == 0
    assert elu.parameter_count() == soft.parameter_count()
    # a trainable map, given as a config dict: one 8x6 matrix per layer
    fm = ks.nn.SequenceClassifier(20, 2, attention="kernel", feature_map=TEST_MAP, **SMALL)
    assert fm.feature_dim == 6
    assert fm.feature_map_parameter_count() == 2 * 8 * 6
    assert fm.parameter_count() == soft.parameter_count() + 2 * 8 * 6
    assert fm.regularization().item() > 0
    same = ks.nn.SequenceClassifier(20, 2, attention=TEST_MAP, **SMALL)  # map as attention
    assert same.feature_map_parameter_count() == 2 * 8 * 6
    kw = ks.nn.CausalLM(20, feature_map="elu", **SMALL)
    assert kw.feature_dim == 8
    tied = ks.nn.CausalLM(20, tie_weights=True, **SMALL)
    untied = ks.nn.CausalLM(20, tie_weights=False, **SMALL)
    assert untied.parameter_count() - tied.parameter_count() == 20 * 16 + 20
    assert soft.config()["attention"] == "softmax"


def test_bool_flags_must_be_bools():
    """A string such as "no" is not read as True (it used to tie the weights)."""
    with pytest.raises(TypeError, match=r"tie_weights must be a bool \(True or False\), got 'no'"):
        ks.nn.CausalLM(20, tie_weights="no", **SMALL)
    lm = ks.nn.CausalLM(20, tie_weights=1, **SMALL)
    assert lm.head.weight is lm.embed.weight and lm.config()["tie_weights"] is True
    with pytest.raises(TypeError, match="trainable_only must be a bool"):
        lm.parameter_count(trainable_only="yes")
    with pytest.raises(TypeError, match="trainable_only must be a bool"):
        lm.feature_map_parameter_count(trainable_only="yes")


def test_bool_flags_take_only_the_ints_0_and_1():
    """0 and 1 stand for False and True; another int (2, -1) is a TypeError, not a truthy
    True (causal=2 ran causal attention)."""
    q = torch.rand(1, 1, 3, 2)
    for flag in (2, -1):
        with pytest.raises(
            TypeError, match=rf"causal must be a bool \(True or False\), got {flag}"
        ):
            ks.linear_attention(q, q, q, causal=flag)
        with pytest.raises(TypeError, match="tie_weights must be a bool"):
            ks.nn.CausalLM(20, tie_weights=flag, **SMALL)
    assert torch.equal(
        ks.linear_attention(q, q, q, causal=1), ks.linear_attention(q, q, q, causal=True)
    )


def test_positional_encodings():
    pe = ks.nn.PositionalEncoding(6, 10, "sinusoidal")
    table = pe(torch.arange(10))
    assert table.shape == (10, 6) and torch.allclose(table[0, 1::2], torch.ones(3))
    assert ks.nn.sinusoidal_positions(torch.arange(3), 5).shape == (3, 5)  # odd width
    learned = ks.nn.PositionalEncoding(6, 4, "learned")
    with pytest.raises(ValueError, match="max_len"):
        learned(torch.arange(5))
    with pytest.raises(ValueError, match="positions must be >= 0, got -1"):  # an IndexError
        learned(torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="d_model must be a positive int, got 'x'"):
        ks.nn.PositionalEncoding("x", 8)  # failed inside torch.arange at the first call
    assert ks.nn.PositionalEncoding(6, 4, "none")(torch.arange(3)).abs().sum() == 0


def test_sinusoidal_positions_follow_vaswani_et_al():
    """Columns 2i and 2i + 1 are sin and cos of pos / 10000^(2i / d_model) (Vaswani et al.,
    the base 10000)."""
    d = 8
    pe = ks.nn.sinusoidal_positions(torch.arange(50), d)
    pos = torch.arange(50, dtype=torch.float64)[:, None]
    angle = pos / 10_000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    torch.testing.assert_close(pe[:, 0::2].double(), torch.sin(angle), rtol=0, atol=1e-5)
    torch.testing.assert_close(pe[:, 1::2].double(), torch.cos(angle), rtol=0, atol=1e-5)


def test_a_cls_model_gives_its_tokens_positions_1_to_n():
    """With pooling="cls" the CLS vector comes first, so the N tokens take learned positions
    1..N: the last token's row N of the table matters, row N + 1 does not (tokens at
    0..N-1 would share CLS's position 0 and never read row N)."""
    torch.manual_seed(0)
    model = ks.nn.SequenceClassifier(
        10, 2, pooling="cls", positions="learned", max_len=8, **{**SMALL, "n_layers": 1}
    ).eval()
    ids = torch.randint(0, 10, (1, 4))
    with torch.no_grad():
        before = model(ids)
        model.positions.table.weight[5] += 10.0  # beyond the 4 tokens' positions
        assert torch.equal(model(ids), before)
        model.positions.table.weight[4] += 10.0  # the last token's position
        assert not torch.equal(model(ids), before)


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="unknown feature map"):
        ks.nn.SequenceClassifier(20, 2, attention="no-such-map", **SMALL)
    with pytest.raises(ValueError, match="divisible"):
        ks.nn.SequenceClassifier(20, 2, d_model=15, n_heads=2)
    with pytest.raises(ValueError, match="feature_map"):
        ks.nn.SequenceClassifier(20, 2, attention="softmax", feature_map="elu")
    with pytest.raises(ValueError, match="feature_map"):
        ks.nn.SequenceClassifier(20, 2, attention="elu", feature_map="relu")
    with pytest.raises(ValueError, match="pooling"):
        ks.nn.SequenceClassifier(20, 2, pooling="max")
    with pytest.raises(ValueError, match="positions"):
        ks.nn.CausalLM(20, positions="rotary")
    with pytest.raises(ValueError, match="num_classes"):
        ks.nn.SequenceClassifier(20, 1)
    for head_dim in (0, -1, 2.5):  # 0 silently became d_model
        with pytest.raises(ValueError, match="head_dim must be an int >= 1"):
            ks.nn.SequenceClassifier(20, 2, head_dim=head_dim)
    with pytest.raises(ValueError, match="d_ff must be a positive int"):
        ks.nn.SequenceClassifier(20, 2, d_ff=True)
    with pytest.raises(ValueError, match="feature_map_kwargs given with attention='softmax'"):
        ks.nn.KernelAttention(8, 2, attention="softmax", feature_map_kwargs={"seed": 0})
    with pytest.raises(ValueError, match="at least one token for mean pooling"):
        ks.nn.SequenceClassifier(20, 2, **SMALL)(_ids(2, 0))  # was NaN logits
    model = ks.nn.SequenceClassifier(20, 2, **SMALL)
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.full((2, 4), 20))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(2, 4))
    with pytest.raises(TypeError, match="mask must have dtype torch.bool"):  # as the core's
        model(_ids(2, 4), torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask"):
        model(_ids(2, 4), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="feature_map_kwargs must be a mapping .*, got int"):
        ks.nn.SequenceClassifier(20, 2, feature_map_kwargs=5)
    lm = ks.nn.CausalLM(20, **SMALL)
    with pytest.raises(ValueError, match="token"):
        lm.step(_ids(2, 1))
    with pytest.raises(TypeError, match="state must be None or the LMState .*, got list"):
        lm.step(_ids(2, 1)[:, 0], [None])
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.generate(_ids(1, 2), -1)
    with pytest.raises(TypeError, match="temperature must be a float, got 'hot'"):
        lm.generate(_ids(1, 2), 2, temperature="hot")
    with pytest.raises(ValueError, match="temperature must be a finite float >= 0"):
        lm.generate(_ids(1, 2), 2, temperature=-1.0)


def test_config_is_not_shared_with_the_callers_dicts():
    """config() kept the caller's nested dicts: changing them later changed the recorded
    config, and a model rebuilt from it no longer loaded the state dict."""
    kwargs = {"num_features": 8}
    models = [
        ks.nn.SequenceClassifier(20, 3, feature_map="favor", feature_map_kwargs=kwargs, **SMALL),
        ks.nn.MatchingClassifier(20, feature_map="favor", feature_map_kwargs=kwargs, **SMALL),
        ks.nn.CausalLM(20, feature_map="favor", feature_map_kwargs=kwargs, **SMALL),
    ]
    kwargs["num_features"] = 64
    for model in models:
        model.config()["feature_map_kwargs"]["num_features"] = 3
        assert model.config()["feature_map_kwargs"] == {"num_features": 8}
        type(model)(**model.config()).load_state_dict(model.state_dict())


def test_an_explicit_map_seed_gives_each_layer_its_own_draw():
    """One seed gave every layer the same FAVOR projection (and the same redraws)."""
    for kw in ({"feature_map_kwargs": {"seed": 5}}, {"feature_map": {"name": "favor", "seed": 5}}):
        a = ks.nn.CausalLM(20, **{"feature_map": "favor", **kw, **SMALL, "n_layers": 3})
        b = ks.nn.CausalLM(20, **{"feature_map": "favor", **kw, **SMALL, "n_layers": 3})
        maps = [layer.attn.feature_map for layer in a.encoder.layers]
        seeds = [m.hparams["seed"] for m in maps]
        assert seeds[0] == 5 and len(set(seeds)) == 3
        one = ks.create_feature_map("favor", head_dim=8, num_heads=2, seed=5)
        assert torch.equal(maps[0].weight, one.weight)  # layer 0: the seed itself
        assert not torch.equal(maps[0].weight, maps[1].weight)
        assert all(  # reproducible
            torch.equal(x.weight, y.weight)
            for x, y in zip(
                maps, [layer.attn.feature_map for layer in b.encoder.layers], strict=True
            )
        )


def test_a_softmax_layer_refuses_a_map_as_the_models_do():
    """Layers >= 1 got a seed in their kwargs, which softmax attention refused (a seed
    error); then a map given with softmax attention was dropped without a word (the models
    refuse it): every layer class now refuses it by name, and a bias flag is checked."""
    favor = {"name": "favor", "seed": 3}
    for n_layers in (1, 2):
        with pytest.raises(ValueError, match=r"feature_map=.*favor.* with attention='softmax'"):
            ks.nn.TransformerEncoder(n_layers, 16, 2, attention="softmax", feature_map=favor)
        ks.nn.TransformerEncoder(n_layers, 16, 2, attention="softmax")
    for fmap in ("hedgehog", 12345):
        with pytest.raises(ValueError, match="given with attention='softmax'"):
            ks.nn.KernelAttention(8, 2, attention="softmax", feature_map=fmap)
        with pytest.raises(ValueError, match="given with attention='softmax'"):
            ks.nn.EncoderLayer(8, 2, 16, attention="softmax", feature_map=fmap)
    assert ks.nn.KernelAttention(8, 2).feature_map.name == "elu"  # the default map
    with pytest.raises(TypeError, match="bias must be a bool"):
        ks.nn.KernelAttention(8, 2, bias="False")  # built biases


def test_mean_pooling_keeps_what_padded_positions_hold_out():
    """Padded positions were multiplied by 0: a NaN or inf held there (a pad embedding gone
    non-finite) made the pooled vector NaN; a row without a real token pools to 0."""
    model = ks.nn.SequenceClassifier(20, 3, **SMALL).eval()
    ids = _ids(2, 6)
    mask = torch.tensor([[True] * 4 + [False] * 2, [False] * 6])
    pooled = model.encode(ids, mask)
    real = model.encoder.forward

    def poisoned(x, key_padding_mask=None):
        h = real(x, key_padding_mask=key_padding_mask)
        return h.masked_fill(~key_padding_mask[..., None], float("nan"))

    model.encoder.forward = poisoned
    again = model.encode(ids, mask)
    assert torch.equal(again, pooled) and torch.equal(again[1], torch.zeros(SMALL["d_model"]))


def test_a_state_of_another_batch_or_layer_is_refused_by_name():
    for attention in ("kernel", "softmax"):
        lm = ks.nn.CausalLM(20, attention=attention, **SMALL).eval()
        _, state = lm.step(_ids(2, 1)[:, 0])
        with pytest.raises(ValueError, match="state holds .*x_t has batch 3"):
            lm.step(_ids(3, 1)[:, 0], state)
        wide = ks.nn.CausalLM(20, attention=attention, **{**SMALL, "d_model": 32}).eval()
        with pytest.raises(ValueError, match="state holds"):
            wide.step(_ids(2, 1)[:, 0], state)
        with pytest.raises(TypeError, match="states must be the list"):
            lm.encoder.step(torch.zeros(2, 16), state.layers[0])


def test_matching_refuses_an_empty_document_by_name():
    model = ks.nn.MatchingClassifier(20, **SMALL)
    with pytest.raises(ValueError, match="input_ids_2 must hold at least one token"):
        model(_ids(2, 4), None, _ids(2, 0))
    with pytest.raises(ValueError, match="input_ids_1 must hold at least one token"):
        model(_ids(2, 0), None, _ids(2, 0))


def test_a_tiny_temperature_samples_the_greedy_tokens():
    """logits / 1e-40 overflowed to inf and softmax gave NaN: multinomial raised."""
    lm = ks.nn.CausalLM(20, **SMALL).eval()
    ids = _ids(2, 3)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(lm.generate(ids, 3, temperature=1e-40, generator=g), lm.generate(ids, 3))
    # below float32's smallest number (1.4e-45) the temperature was 0 there: 0/0, NaN
    assert torch.equal(lm.generate(ids, 3, temperature=1e-46, generator=g), lm.generate(ids, 3))
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.generate(ids, True)


def test_models_with_neighbouring_map_seeds_share_no_layer_draw():
    """Layer i drew with seed + i, so the models of seeds 5 and 6 (two runs of a study)
    shared two of their three FAVOR projections and were not independent."""
    from kernelstudy.nn.encoder import layer_seed

    def weights(seed: int) -> list[torch.Tensor]:
        lm = ks.nn.CausalLM(
            20, feature_map={"name": "favor", "seed": seed}, **{**SMALL, "n_layers": 3}
        )
        return [layer.attn.feature_map.weight for layer in lm.encoder.layers]

    a, b = weights(5), weights(6)
    assert not any(torch.equal(x, y) for x in a for y in b)
    seeds = {layer_seed(s, i) for s in range(200) for i in range(8)}
    assert len(seeds) == 200 * 8  # no seed of one (seed, layer) is another's
    assert all(0 <= s < 2**32 for s in seeds)
    assert layer_seed(-1, 2) == -1 and layer_seed(2**32, 1) == 2**32  # the map refuses these


def test_generate_checks_learned_positions_before_any_step(monkeypatch):
    """A generation past max_len of learned positions failed only at the step that reached
    it, after every step before it had run, naming a position but not the request."""
    model = ks.nn.CausalLM(20, positions="learned", max_len=16, **SMALL).eval()
    prompt = _ids(2, 10)
    assert model.generate(prompt, 7).shape == (2, 17)  # 16 positions read: the last is not fed
    calls = []
    step = model._step
    monkeypatch.setattr(model, "_step", lambda *a: calls.append(1) or step(*a))
    with pytest.raises(ValueError, match=r"prompt length 10 \+ max_new_tokens 8 needs 17 pos"):
        model.generate(prompt, 8)
    assert calls == []


def test_generate_with_no_new_token_reads_no_position():
    """max_new_tokens = 0 returns the prompt without running the model, yet a prompt longer
    than learned positions' max_len was refused as needing its length in positions."""
    model = ks.nn.CausalLM(20, positions="learned", max_len=8, **SMALL)
    prompt = _ids(2, 9)
    assert torch.equal(model.generate(prompt, 0), prompt)
    with pytest.raises(ValueError, match="needs 9 positions"):
        model.generate(prompt, 1)


def test_every_eval_mode_use_gives_each_submodule_its_own_mode_back(tmp_path):
    """generate, analysis.generate, benchmark_generation, Trainer.evaluate and fit_to_softmax
    restored the top-level mode with ``train(was)``, which sets every submodule alike: a
    redrawing map the caller had put in eval mode (no redraws while the rest trains) came
    back training, redrawing again."""
    favor = {"name": "favor", "num_features": 8, "redraw_every": 1, "seed": 0}
    model = ks.nn.CausalLM(20, feature_map=favor, **SMALL).train()
    maps = ks.nn.models.feature_maps_of(model)
    for fm in maps:
        fm.eval()

    def modes():
        return [m.training for m in model.modules()]

    before = modes()
    assert before.count(False) == len(maps) and before[0]
    prompt = _ids(2, 3)
    model.generate(prompt, 2)
    assert modes() == before
    ks.analysis.generate(model, prompt, 2, mode="step")
    assert modes() == before
    ks.analysis.benchmark_generation({"lm": (model, "step")}, [2], repeats=1, warmup=0)
    assert modes() == before
    from kernelstudy.tasks import CopyTask
    from kernelstudy.train import TrainConfig, Trainer

    data = CopyTask("val", seq_len=8, n_symbols=10, num_samples=8)
    cfg = TrainConfig(steps=2, eval_every=1, batch_size=4, progress=False, device="cpu")
    trainer = Trainer(model, data, cfg, val_data=data)
    trainer.evaluate(data)
    assert modes() == before
    seeds = [fm.hparams["seed"] for fm in maps]
    trainer.fit()  # its steps set the whole model training (the map redrew at every step)
    assert modes() == before and [fm.hparams["seed"] for fm in maps] == seeds
    glu = ks.create_feature_map("glu", head_dim=8, depth=2, seed=0)
    inner = next(m for m in glu.modules() if m is not glu)
    inner.eval()
    glu_modes = [m.training for m in glu.modules()]
    q, k = torch.randn(2, 1, 2, 8, 8).unbind(0)
    ks.analysis.fit_to_softmax(glu, q, k, steps=1)
    assert [m.training for m in glu.modules()] == glu_modes and not inner.training
    ks.analysis.approximation_error(glu, q, k)  # float64 scores of a float32 map
    assert [m.training for m in glu.modules()] == glu_modes


@pytest.mark.parametrize("mode", ["step", "full"])
def test_analysis_generate_decodes_in_eval_mode(mode):
    """ks.analysis.generate ran in the caller's mode: in training, dropout made greedy decoding
    random, a redrawing map redrew its features at every "full" forward (and changed the
    model's seed) and refused "step"."""
    torch.manual_seed(0)
    favor = {"name": "favor", "num_features": 8, "redraw_every": 1, "seed": 0}
    model = ks.nn.CausalLM(20, feature_map=favor, **{**SMALL, "dropout": 0.5}).train()
    seeds = [fm.hparams["seed"] for fm in ks.nn.models.feature_maps_of(model)]
    prompt = _ids(3, 4)
    tokens, _ = ks.analysis.generate(model, prompt, 6, mode=mode)
    assert model.training  # the caller's mode back
    assert [fm.hparams["seed"] for fm in ks.nn.models.feature_maps_of(model)] == seeds
    assert torch.equal(tokens, model.generate(prompt, 6))


@pytest.mark.parametrize("attention", ["softmax", "elu", "favor"])
def test_generate_continues_prompts_of_different_lengths(attention):
    """Prompts of different lengths (a right-padded mask): each row continues as if it were
    generated alone, whatever its padding holds, and ends in pad_id."""
    torch.manual_seed(0)
    model = ks.nn.CausalLM(20, attention=attention, **SMALL).eval()
    lengths = [3, 6, 1, 6]
    prompt = _ids(4, 7)
    mask = torch.arange(7) < torch.tensor(lengths)[:, None]
    prompt[~mask] = 19  # padding holds real-looking ids: only the mask says what is real
    out = model.generate(prompt, 5, mask=mask, pad_id=2)
    assert out.shape == (4, 12)
    for b, n in enumerate(lengths):
        alone = model.generate(prompt[b : b + 1, :n], 5)
        assert torch.equal(out[b, : n + 5], alone[0])
        assert (out[b, n + 5 :] == 2).all()
    # all rows real: the same as no mask
    full = torch.ones_like(prompt, dtype=torch.bool)
    assert torch.equal(model.generate(prompt, 4, mask=full), model.generate(prompt, 4))
    assert torch.equal(model.generate(prompt, 0, mask=mask, pad_id=2), prompt.where(mask, 2))


def test_generate_samples_a_ragged_batch_and_keeps_unmasked_draws():
    """Sampling draws from the generator only once some row has ended its prompt: without a
    mask the draws are those of feeding the whole prompt, then one draw per new token."""
    torch.manual_seed(0)
    model = ks.nn.CausalLM(20, **SMALL).eval()
    prompt = _ids(3, 4)
    out = model.generate(prompt, 5, temperature=0.7, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        state, seq = None, [prompt]
        for t in range(4):
            logits, state = model.step(prompt[:, t], state)
        for i in range(5):
            probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / 0.7, -1)
            token = torch.multinomial(probs, 1, generator=g)[:, 0]
            seq.append(token[:, None])
            if i < 4:
                logits, state = model.step(token, state)
    assert torch.equal(out, torch.cat(seq, 1))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    g = torch.Generator().manual_seed(3)
    ragged = model.generate(prompt, 5, temperature=1.0, generator=g, mask=mask, pad_id=0)
    assert torch.equal(ragged[mask.sum(1) > 0, :1], prompt[:, :1])
    for b, n in enumerate([2, 4, 1]):
        assert torch.equal(ragged[b, :n], prompt[b, :n]) and (ragged[b, n + 5 :] == 0).all()


def test_generate_refuses_a_bad_prompt_mask():
    model = ks.nn.CausalLM(20, positions="learned", max_len=12, **SMALL).eval()
    prompt = _ids(2, 8)
    left = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], dtype=torch.bool)
    with pytest.raises(ValueError, match="right padding"):
        model.generate(prompt, 2, mask=left)
    empty = torch.tensor([[0] * 8, [1] * 8], dtype=torch.bool)
    with pytest.raises(ValueError, match="at least one real token"):
        model.generate(prompt, 2, mask=empty)
    with pytest.raises(TypeError, match="mask must have dtype torch.bool"):
        model.generate(prompt, 2, mask=torch.ones(2, 8))
    with pytest.raises(ValueError, match=r"mask must have shape \(batch, seq\) = \(2, 8\)"):
        model.generate(prompt, 2, mask=torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"pad_id must be an int <= 19"):
        model.generate(prompt, 2, pad_id=20)
    # learned positions: the longest real prompt counts, not the padded width
    short = torch.arange(8) < torch.tensor([[5], [6]])
    assert model.generate(prompt, 7, mask=short).shape == (2, 15)
    with pytest.raises(ValueError, match=r"prompt length 6 \+ max_new_tokens 8 needs 13"):
        model.generate(prompt, 8, mask=short)


def test_generate_ends_rows_at_eos_and_returns_int64_ids():
    """eos_id ends a row (the eos kept, pad_id after it); ids of a narrow prompt dtype come
    back as int64, so new tokens beyond the prompt dtype's range are not wrapped."""
    torch.manual_seed(0)
    model = ks.nn.CausalLM(300, **SMALL).eval()
    prompt = torch.randint(0, 256, (3, 4), dtype=torch.uint8)
    free = model.generate(prompt, 8)
    assert free.dtype == torch.int64 and torch.equal(free, model.generate(prompt.long(), 8))
    eos = int(free[0, 6])  # row 0's third new token
    out = model.generate(prompt, 8, eos_id=eos, pad_id=299)
    for b in range(3):
        new = free[b, 4:].tolist()
        end = new.index(eos) + 1 if eos in new else 8
        assert out[b, 4 : 4 + end].tolist() == new[:end]
        assert (out[b, 4 + end :] == 299).all()
    calls = []
    step, steps = model._step, model._steps
    model._step = lambda *a: calls.append(1) or step(*a)
    model._steps = lambda tokens, state: calls.append(tokens.shape[1]) or steps(tokens, state)
    one = model.generate(prompt[:1], 8, eos_id=eos)
    first = free[0, 4:].tolist().index(eos)  # the new token that ends row 0
    # the prompt in one pass, then a step a new token up to the eos (not fed back)
    assert one.shape == (1, 12) and calls == [4] + [1] * first
    with pytest.raises(ValueError, match=r"eos_id must be an int <= 299"):
        model.generate(prompt, 2, eos_id=300)


def test_an_eos_predicted_inside_a_longer_prompt_does_not_end_its_row():
    """A ragged batch with eos_id: each row equals its lone generation. The model's guess of
    eos while a row still reads its prompt must not end that row (pad_id, no new tokens)
    while a shorter row is already generating."""
    torch.manual_seed(0)
    model = ks.nn.CausalLM(20, **SMALL).eval()
    long = _ids(1, 6)
    with torch.no_grad():
        eos = int(model(long).argmax(-1)[0, 1])  # its guess after 2 of its 6 prompt tokens
    prompt = torch.cat([long, long.roll(1, dims=1)])
    mask = torch.arange(6) < torch.tensor([[6], [1]])
    pad = next(i for i in range(20) if i != eos)
    both = model.generate(prompt, 4, mask=mask, eos_id=eos, pad_id=pad)
    assert torch.equal(both[0], model.generate(long, 4, eos_id=eos, pad_id=pad)[0])
    alone = model.generate(prompt[1:, :1], 4, eos_id=eos, pad_id=pad)[0]
    assert torch.equal(both[1, :5], alone) and (both[1, 5:] == pad).all()


@pytest.mark.parametrize("cls", ["SequenceClassifier", "CausalLM"])
@pytest.mark.parametrize(("max_len", "pooling"), [("64", "mean"), (True, "mean"), (0, "cls")])
def test_a_bad_max_len_is_named_before_the_cls_position_is_added(cls, max_len, pooling):
    """max_len + extra_positions ran before any check: a str failed with "can only
    concatenate str (not "int") to str" (also from ``kernelstudy train --model-arg
    max_len=x``), True was read as max_len 1 and 0 with pooling="cls" as 1."""
    kwargs = {"pooling": pooling} if cls == "SequenceClassifier" else {}
    args = (20, 2) if cls == "SequenceClassifier" else (20,)
    if cls == "CausalLM" and pooling == "cls":
        pytest.skip("a CausalLM has no pooling")
    with pytest.raises(ValueError, match=rf"max_len must be a positive int, got {max_len!r}"):
        getattr(ks.nn, cls)(*args, positions="learned", max_len=max_len, **kwargs, **SMALL)


def test_ids_on_another_device_than_the_model_are_named():
    """torch's "Expected all tensors to be on the same device" named no argument (here: a
    model on the meta device stands for one on a GPU; the ids stay on the CPU)."""
    lm = ks.nn.CausalLM(10, d_model=8, n_heads=2, n_layers=1).to("meta")
    clf = ks.nn.SequenceClassifier(10, 3, d_model=8, n_heads=2, n_layers=1).to("meta")
    pair = ks.nn.MatchingClassifier(10, 3, d_model=8, n_heads=2, n_layers=1).to("meta")
    ids = torch.zeros(2, 4, dtype=torch.long)
    for call, name in (
        (lambda: lm(ids), "input_ids"),
        (lambda: lm.step(ids[:, 0]), "token"),
        (lambda: lm.generate(ids, max_new_tokens=1), "prompt"),
        (lambda: clf(ids), "input_ids"),
        (lambda: pair(ids, input_ids_2=ids), "input_ids_1"),
    ):
        with pytest.raises(ValueError, match=rf"{name} is on cpu, the model on meta: move"):
            call()


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_models_on_the_meta_device_infer_shapes_with_every_map(positions):
    """A model built under ``torch.device("meta")`` and given meta ids (shapes without
    memory) failed with 'Tensor.item() cannot be called on meta tensors': the ids' range
    check, learned positions' and a causal per-sequence stabilizer's sync read values."""
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    mask = torch.ones(2, 5, dtype=torch.bool, device="meta")
    for name in ks.list_feature_maps():
        size = {"d_model": 8, "n_heads": 2, "n_layers": 1, "feature_map": name}
        size |= {"positions": positions, "max_len": 8}
        with torch.device("meta"):
            lm, clf = ks.nn.CausalLM(11, **size), ks.nn.SequenceClassifier(11, 3, **size)
        assert lm(ids).shape == (2, 5, 11) and lm(ids).is_meta, name
        assert clf(ids, mask).shape == (2, 3), name


def test_positions_must_be_a_1d_integer_tensor():
    """A batch-shaped ``(1, N)`` gave one row, the encoding of no position (the learned kind
    gave (1, N, d)); lists and numpy arrays failed on ``.to``, d_model=0 divided by zero."""
    for kind in ("sinusoidal", "learned", "none", None):
        enc = ks.nn.PositionalEncoding(8, 16, kind)
        assert enc(torch.arange(4)).shape == (4, 8)
        with pytest.raises(ValueError, match=r"positions must be 1-D \(N,\), got shape \(1, 4\)"):
            enc(torch.arange(4)[None])
        with pytest.raises(TypeError, match="positions must be a torch.Tensor, got list"):
            enc([0, 1])
        with pytest.raises(TypeError, match="positions must be an integer tensor, got torch.fl"):
            enc(torch.arange(4.0))
    assert ks.nn.PositionalEncoding(8, 16, None).kind == "none"  # --model-arg positions=none
    with pytest.raises(ValueError, match="d_model must be a positive int, got 0"):
        ks.nn.sinusoidal_positions(torch.arange(3), 0)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor compiles C++ for the CPU")
def test_models_compile_whole_with_inductor():
    """``torch.compile(model, fullgraph=True)`` with inductor (code generated and compiled for
    this CPU): a causal LM (the ``cpu`` backend's kernels as custom ops where it is built) and a
    classifier on padded inputs give eager mode's loss and every parameter's gradient within
    1e-5 relative (float32; inductor fuses the ops around the core in its own order). Ids out
    of range fail the graph's own check, which names ``input_ids`` (a RuntimeError on the CPU;
    eager mode's is a ValueError that also gives the range of the ids)."""
    lm = ks.nn.CausalLM(20, **SMALL)
    clf = ks.nn.SequenceClassifier(20, 3, **SMALL)
    ids, mask = _padded([13, 9], 13)
    cases = (
        (lm, lambda m: F.cross_entropy(m(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())),
        (clf, lambda m: F.cross_entropy(m(ids, mask), torch.tensor([0, 2]))),
    )
    for model, loss_of in cases:
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        results = outputs_and_grads(model, (compiled, model), loss_of, scalar=lambda loss: loss)
        for got, want in zip(*results, strict=True):
            assert rel_err(got, want, floor=1e-3) <= 1e-5
    with pytest.raises(RuntimeError, match=r"input_ids must lie in \[0, 20\)"):
        compiled(torch.full_like(ids, 20), mask)  # the check in the graph (torch >= 2.9)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_every_model_compiles_whole(attention):
    """``torch.compile(model, fullgraph=True)`` traces each model without a graph break
    (learned positions, ``cls`` pooling, two towers, padding): outputs and every parameter's
    gradient equal eager mode's bit for bit (float64, dropout off). A position past a learned
    encoding's ``max_len`` fails the graph's own check (a RuntimeError naming it)."""
    small = SMALL | {"attention": attention}
    ids, mask = _padded([12, 7], 12)
    other, other_mask = _padded([5, 9], 12)
    cases = [
        (ks.nn.SequenceClassifier(20, 3, pooling="cls", positions="learned", max_len=13, **small),
         (ids, mask)),
        (ks.nn.MatchingClassifier(20, positions="learned", max_len=12, **small),
         (ids, mask, other, other_mask)),
        (ks.nn.CausalLM(20, positions="learned", max_len=12, **small), (ids, mask)),
    ]  # fmt: skip
    for model, inputs in cases:
        model = model.double()
        compiled = compiled_whole(model)
        results = outputs_and_grads(model, (compiled, model), lambda run, x=inputs: run(*x))
        for got, want in zip(*results, strict=True):
            assert torch.equal(got, want), type(model).__name__
    longer = torch.cat([ids, ids[:, :1]], 1)
    with pytest.raises(ValueError, match="max_len"):
        model(longer)
    with pytest.raises(RuntimeError, match="max_len=12"):
        compiled(longer)


@pytest.mark.parametrize("cls", ["SequenceClassifier", "MatchingClassifier"])
def test_a_cls_model_names_the_max_len_it_was_given(cls):
    """The CLS token takes a position: an input one token too long was refused as "beyond
    max_len=6" for a model built with max_len=5."""
    model = getattr(ks.nn, cls)(10, 2, pooling="cls", positions="learned", max_len=5, **SMALL)
    ids = torch.randint(0, 10, (1, 5))
    model(ids) if cls == "SequenceClassifier" else model(ids, input_ids_2=ids)
    long = torch.randint(0, 10, (1, 6))
    name = "input_ids" if cls == "SequenceClassifier" else "input_ids_2"
    with pytest.raises(ValueError, match=rf"{name} has 6 tokens, beyond max_len=5 of the"):
        model(long) if cls == "SequenceClassifier" else model(ids, input_ids_2=long)


def test_configs_with_numpy_numbers_inside_dicts_are_json():
    """Only the top-level arguments were made plain: a numpy int in feature_map_kwargs or
    an attention config made config() unserializable ("int64 is not JSON serializable")."""
    import json

    import numpy as np

    fm_kwargs = {"num_features": np.int64(8), "seed": np.int64(3), "orthogonal": np.False_}
    clf = ks.nn.SequenceClassifier(10, 2, attention="favor", feature_map_kwargs=fm_kwargs, **SMALL)
    lm = ks.nn.CausalLM(10, attention={"name": "favor", "num_features": np.int64(8)}, **SMALL)
    for model in (clf, lm):
        config = json.loads(json.dumps(model.config()))
        rebuilt = type(model)(**config)
        rebuilt.load_state_dict(model.state_dict())
        ids = torch.randint(0, 10, (2, 7))
        model.eval(), rebuilt.eval()
        assert torch.equal(model(ids), rebuilt(ids))


def test_a_generator_map_seed_is_recorded_as_the_int_drawn_from_it():
    """A ``torch.Generator`` seed (every random map takes one) stayed in config(): not JSON,
    run.json held its repr, load_model failed on it, and ``type(model)(**config())`` drew
    other maps (the copied Generator had advanced)."""
    import json

    def maps(model):
        return [m.weight for m in ks.nn.feature_maps_of(model)]

    kinds = [
        (ks.nn.CausalLM, {"feature_map": "favor", "feature_map_kwargs": {"num_features": 8}}),
        (ks.nn.SequenceClassifier, {"num_classes": 2, "attention": {"name": "favor"}}),
        (ks.nn.MatchingClassifier, {"feature_map": {"name": "trig_rf", "num_features": 8}}),
    ]
    for cls, kwargs in kinds:
        for key in ("attention", "feature_map", "feature_map_kwargs"):
            if isinstance(kwargs.get(key), dict):  # the dict that holds the map's arguments
                kwargs[key] = {**kwargs[key], "seed": torch.Generator().manual_seed(3)}
        model = cls(10, **kwargs, **{**SMALL, "n_layers": 2})
        config = json.loads(json.dumps(model.config()))
        rebuilt = cls(**config)
        assert all(torch.equal(a, b) for a, b in zip(maps(model), maps(rebuilt), strict=True))
        assert not torch.equal(*maps(model))  # the layers still draw apart
        again = cls(10, **kwargs | {}, **{**SMALL, "n_layers": 2})  # another Generator state
        assert again.config() != model.config()


def test_sinusoidal_positions_are_float32_whatever_the_default_dtype():
    """As documented (the table took the default dtype: float64 values of float32 sines)."""
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert ks.nn.sinusoidal_positions(torch.arange(4), 6).dtype == torch.float32
    finally:
        torch.set_default_dtype(before)
