"""graphattn as a Hugging Face transformers attention implementation (graphattn.torch.register_transformers):
a small Llama-like model with random weights against transformers' "sdpa" on the same weights."""
import copy
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import graphattn.torch  # noqa: E402
from graphattn.testing import GRAD_TOLERANCES, assert_close  # noqa: E402
from graphattn.dtypes import DataType  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = graphattn.torch.register_transformers()


def _models(family: str = "Llama", peer: str = "sdpa", **extra):
    """The same random model of this family (GQA: 8 query heads over 2 K/V heads) as graphattn and as the peer
    implementation."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    ours = getattr(transformers, f"{family}ForCausalLM")(config)
    for module in ours.modules():  # gpt-oss's sinks start at 0: random ones test them
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            with torch.no_grad():
                module.sinks.normal_()
    theirs = copy.deepcopy(ours)
    ours.config._attn_implementation = NAME
    theirs.config._attn_implementation = peer
    return ours, theirs


def _inputs(padding: bool):
    torch.manual_seed(1)
    ids = torch.randint(1, 97, (2, 13))
    mask = torch.ones_like(ids)
    if padding:
        mask[0, :4] = 0  # left padding of the first row
        ids[0, :4] = 0
    return ids, mask


def test_register_returns_the_name_and_checks_it():
    assert NAME == "graphattn"
    assert graphattn.torch.register_transformers("graphattn_2") == "graphattn_2"
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        graphattn.torch.register_transformers("")


@pytest.mark.parametrize("padding", [False, True], ids=["unpadded", "left_padded"])
def test_logits_match_sdpa(padding):
    ours, theirs = _models()
    ids, mask = _inputs(padding)
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits
        want = theirs(input_ids=ids, attention_mask=mask).logits
    kept = mask.bool()  # padded positions' logits are not defined alike (rows that see no key)
    assert_close(got[kept].numpy(), want[kept].numpy(), DataType.f32, "logits")


def test_greedy_generate_with_a_kv_cache_matches_sdpa():
    ours, theirs = _models()
    ids, mask = _inputs(padding=True)
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **settings), theirs.generate(ids, **settings))


@pytest.mark.parametrize("padding", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_generate_with_a_paged_cache_matches_sdpa(padding, block_size, monkeypatch):
    """graphattn.hf_cache.PagedCache as generate's cache: the same greedy tokens as sdpa with transformers' own
    cache, every step through the paged kernel call, the blocks written in place (never reallocated)."""
    from graphattn import kv_cache
    from graphattn.hf_cache import PagedCache

    calls = []
    real = kv_cache.attention_with_kv_cache
    monkeypatch.setattr(kv_cache, "attention_with_kv_cache", lambda *a, **k: calls.append(1) or real(*a, **k))
    ours, theirs = _models()
    ids, mask = _inputs(padding)
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    cache = PagedCache(max_cache_len=ids.shape[1] + 6, block_size=block_size)
    with torch.no_grad():
        got = ours.generate(ids, cache=cache, **settings)
        want = theirs.generate(ids, **settings)
    assert torch.equal(got, want)
    layers = ours.config.num_hidden_layers
    assert len(calls) == 6 * layers  # the prompt and 5 decode steps, each layer once
    first = cache.layers[0]
    assert cache.get_seq_length() == ids.shape[1] + 5 and first.keys.shape[1] == block_size
    pointer = first.keys.data_ptr()
    with torch.no_grad():  # one more step on the same cache: its blocks stay where they are
        ours(input_ids=got[:, -1:], attention_mask=torch.cat([mask, torch.ones(2, 6, dtype=mask.dtype)], 1),
             cache=cache, use_cache=True)
    assert first.keys.data_ptr() == pointer and cache.get_seq_length() == ids.shape[1] + 6


@pytest.mark.parametrize("kv_format", ["u8", "s8", "u4", "fp8_e4m3"])
def test_generate_with_a_quantized_paged_cache(kv_format):
    """PagedCache(kv_format=...): the blocks hold the format's bytes (quantized on write), generate runs through
    them, and the logits of its steps stay near sdpa's with transformers' own cache (8 bits: the same tokens)."""
    from graphattn.hf_cache import PagedCache

    ours, theirs = _models()
    ids, mask = _inputs(True)
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                    return_dict_in_generate=True)
    cache = PagedCache(max_cache_len=ids.shape[1] + 4, block_size=3, kv_format=kv_format)  # G = D = 8
    with torch.no_grad():
        got = ours.generate(ids, cache=cache, **settings)
        want = theirs.generate(ids, **settings)
    first = cache.layers[0]
    assert first.keys.dtype in (torch.uint8, torch.int8) and first.keys.dtype == first.values.dtype
    head_dim = ours.config.hidden_size // ours.config.num_attention_heads
    assert first.keys.shape[-1] == (head_dim // 2 if kv_format == "u4" else head_dim)
    rel = float((got.logits[0] - want.logits[0]).abs().max() / want.logits[0].abs().max())  # the prompt step
    assert rel < (0.01 if kv_format in ("u8", "s8") else 0.15), rel
    if kv_format in ("u8", "s8"):
        assert torch.equal(got.sequences, want.sequences)


def test_a_paged_cache_beyond_its_length_is_refused():
    from graphattn.hf_cache import PagedCache

    ours, _ = _models()
    ids, mask = _inputs(False)
    with torch.no_grad(), pytest.raises(ValueError, match="capacity"):
        ours.generate(ids, attention_mask=mask, cache=PagedCache(max_cache_len=ids.shape[1] + 2),
                      max_new_tokens=6, do_sample=False, pad_token_id=0)


def test_training_step_gradients_match_sdpa():
    """Every parameter gets a gradient, and it matches sdpa's (autograd through graphattn's fused backward)."""
    ours, theirs = _models()
    ids, mask = _inputs(padding=True)
    labels = ids.masked_fill(mask == 0, -100)
    for model in (ours, theirs):
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    rtol, atol = GRAD_TOLERANCES[DataType.f32]
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert p.grad is not None, f"{name} got no gradient"
        scale = float(q.grad.abs().max()) or 1.0
        assert_close(p.grad.numpy(), q.grad.numpy(), DataType.f32, name, (rtol, atol * scale))


def test_example_runs_and_agrees():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "hf_llama.py"), "--steps", "1",
                          "--new-tokens", "4", "--seq", "16", "--hidden", "64"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "generated tokens agree between graphattn and sdpa" in out.stdout, out.stdout
    assert "graphattn  train" in out.stdout and "sdpa       train" in out.stdout


@pytest.mark.parametrize("padding", [False, True], ids=["unpadded", "left_padded"])
def test_a_sliding_window_model_passes_its_window(padding, monkeypatch):
    """A Mistral-like model with a window of 4 keys: graphattn gets the window as window=(3, -1), aligned to the
    keys' end, and matches sdpa (which applies it as a mask) on logits and on greedy generation."""
    seen = []
    call = graphattn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("window"), kwargs.get("causal_alignment")))
        return call(*args, **kwargs)

    monkeypatch.setattr(graphattn.functional, "scaled_dot_product_attention", spy)
    ours, theirs = _models("Mistral", sliding_window=4)
    ids, mask = _inputs(padding)
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits
        want = theirs(input_ids=ids, attention_mask=mask).logits
    assert seen and all(s == ((3, -1), "bottom_right") for s in seen), seen
    kept = mask.bool()
    assert_close(got[kept].numpy(), want[kept].numpy(), DataType.f32, "logits")
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **settings), theirs.generate(ids, **settings))


def test_a_bad_sliding_window_is_refused():
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        graphattn.torch.attention_forward(None, q, q, q, None, sliding_window=0)


# Models whose attention needs the score modifiers (issue: softcap, ALiBi and sinks on the spine), against
# transformers' eager attention, which applies them itself (sdpa takes neither).
MODIFIER_MODELS = {
    "gemma2_softcap_window": ("Gemma2", dict(sliding_window=4, attn_logit_softcapping=2.0, query_pre_attn_scalar=16,
                                             head_dim=16), {"softcap": 2.0}),
    "gpt_oss_sinks_window": ("GptOss", dict(sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
                                            head_dim=16), {"sinks": True}),
}


@pytest.mark.parametrize("model", sorted(MODIFIER_MODELS))
def test_modifier_models_match_eager(model, monkeypatch):
    """Gemma 2's softcap and gpt-oss's sinks reach graphattn as its own arguments (not as a mask), with their
    sliding windows; logits and greedy generation with left padding, and every parameter's gradient (the
    sinks' included), match eager."""
    family, extra, expected = MODIFIER_MODELS[model]
    seen = []
    call = graphattn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return call(*args, **kwargs)

    monkeypatch.setattr(graphattn.functional, "scaled_dot_product_attention", spy)
    ours, theirs = _models(family, peer="eager", **extra)
    ids, mask = _inputs(padding=True)
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits
        want = theirs(input_ids=ids, attention_mask=mask).logits
    assert seen and all(kw.get("softcap") == expected.get("softcap") for kw in seen), seen
    assert all((kw.get("sinks") is not None) == bool(expected.get("sinks")) for kw in seen)
    assert any(kw.get("window") == (3, -1) for kw in seen), "the sliding layers pass their window"
    kept = mask.bool()
    assert_close(got[kept].numpy(), want[kept].numpy(), DataType.f32, "logits")
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **settings), theirs.generate(ids, **settings))
    # Training without padding: eager's rows that see no key (the left padding's) take a different loss than
    # sdpa's, whose graphattn matches on a model both take (Gemma 2 without a softcap).
    ids, _ = _inputs(padding=False)
    for m in (ours, theirs):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
    rtol, atol = GRAD_TOLERANCES[DataType.f32]
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        if q.grad is None:  # experts no token was routed to
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None, f"{name} got no gradient"
        scale = float(q.grad.abs().max()) or 1.0
        assert_close(p.grad.numpy(), q.grad.numpy(), DataType.f32, name, (rtol, atol * scale))


def _counting_varlen(monkeypatch):
    """Counts the calls that reach graphattn.varlen_attention."""
    import graphattn.varlen

    calls = []
    original = graphattn.varlen.varlen_attention

    def counted(*args, **kwargs):
        calls.append(args[3])
        return original(*args, **kwargs)

    monkeypatch.setattr(graphattn.varlen, "varlen_attention", counted)
    return calls


def test_flash_name_trains_padding_free_as_sdpa_per_sequence(monkeypatch):
    """DataCollatorWithFlattening's packed row through "graphattn_flash" (varlen) gives each sequence's own
    loss and gradients: those of "sdpa" on the sequences one by one."""
    calls = _counting_varlen(monkeypatch)
    ours, theirs = _models()
    ours.config._attn_implementation = graphattn.torch.FLASH_NAME
    torch.manual_seed(2)
    seqs = [torch.randint(0, 97, (n,)).tolist() for n in (7, 13, 1, 5)]
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": s} for s in seqs])
    loss = ours(**batch).loss
    loss.backward()
    total, count = 0.0, 0
    for s in seqs:
        ids = torch.tensor([s])
        if len(s) > 1:
            total = total + theirs(input_ids=ids, labels=ids).loss * (len(s) - 1)
            count += len(s) - 1
    (total / count).backward()
    assert calls, "the packed row did not reach varlen_attention"
    assert_close(loss.detach().numpy(), (total / count).detach().numpy(), "f32")
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        rtol, atol = GRAD_TOLERANCES[DataType.f32]
        assert_close(a.grad.numpy(), b.grad.numpy(), "f32", name, (10 * rtol, 10 * atol))


def test_flash_name_runs_continuous_batching(monkeypatch):
    """model.generate_batch (transformers' continuous batching) on the CPU through "graphattn_flash": varlen
    calls, and the greedy tokens of "sdpa"."""
    calls = _counting_varlen(monkeypatch)
    ours, theirs = _models()
    ours.config._attn_implementation = graphattn.torch.FLASH_NAME
    torch.manual_seed(3)
    prompts = [torch.randint(1, 97, (n,)).tolist() for n in (7, 13, 5)]
    config = transformers.GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    ours_out = ours.generate_batch(inputs=prompts, generation_config=config)
    theirs_out = theirs.generate_batch(inputs=prompts, generation_config=config)
    assert calls and any(len(cu) > 2 for cu in calls), "no packed call of several sequences reached varlen"
    assert sorted(ours_out) == sorted(theirs_out)
    for key in ours_out:
        assert ours_out[key].generated_tokens == theirs_out[key].generated_tokens


def test_flash_name_with_a_padded_batch_generates_as_sdpa():
    ours, theirs = _models()
    ours.config._attn_implementation = graphattn.torch.FLASH_NAME
    torch.manual_seed(4)
    ids = torch.randint(1, 97, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    args = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **args), theirs.generate(ids, **args))
