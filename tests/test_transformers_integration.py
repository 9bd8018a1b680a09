"""Hugging Face transformers with attn_implementation="mhattn": a tiny random Llama (built from a config, no
downloads) generates the tokens "sdpa" generates, and a packed training step matches a padded one."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mhattn.integrations.transformers as mhattn_hf  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def tiny_llama(attn_implementation, dtype=torch.float64, device="cpu", seed=0):
    mhattn_hf.register()
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(device=device, dtype=dtype).eval()


def generate(model, input_ids, attention_mask=None):
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=32, min_new_tokens=32,
                              do_sample=False)


def check_generation_matches_sdpa(dtype, device):
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 97, (1, 11), generator=gen).to(device)
    tokens = {name: generate(tiny_llama(name, dtype, device), prompt) for name in ("sdpa", "mhattn")}
    assert tokens["mhattn"].shape == (1, 11 + 32)
    assert torch.equal(tokens["mhattn"], tokens["sdpa"])
    # Two prompts, the shorter left-padded: the padding mask reaches mhattn as a 2-D mask.
    prompts = torch.randint(3, 97, (2, 9), generator=gen).to(device)
    mask = torch.ones_like(prompts)
    mask[1, :4] = 0
    prompts[1, :4] = 0
    tokens = {name: generate(tiny_llama(name, dtype, device), prompts, mask) for name in ("sdpa", "mhattn")}
    assert torch.equal(tokens["mhattn"], tokens["sdpa"])


def test_greedy_generation_matches_sdpa():
    check_generation_matches_sdpa(torch.float64, "cpu")


def test_sliding_window_model_with_padding_matches_sdpa():
    """A tiny random Mistral (sliding window 8) on a left-padded batch: logits and greedy tokens as "sdpa"."""
    mhattn_hf.register()
    config = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        sliding_window=8, pad_token_id=0)
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 97, (2, 13), generator=gen)
    mask = torch.ones_like(prompts)
    mask[1, :4] = 0
    results = {}
    for name in ("sdpa", "mhattn"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name).double().eval()
        with torch.no_grad():
            logits = model(prompts, attention_mask=mask).logits[mask.bool()]
        results[name] = (logits, generate(model, prompts, mask))
    assert float((results["mhattn"][0] - results["sdpa"][0]).abs().max()) < 1e-10
    assert torch.equal(results["mhattn"][1], results["sdpa"][1])


def test_padding_reaches_attention_as_a_key_padding_mask():
    """With a padding mask and as many queries as keys (a prompt, a training batch), mhattn.attention gets the padding
    as a (B, 1, 1, Nk) key-padding mask and the causal bound as its window (-1, 0), not a (B, 1, Nq, Nk) mask made for
    the call; the logits stay the "sdpa" ones."""
    gen = torch.Generator().manual_seed(4)
    prompts = torch.randint(3, 97, (2, 9), generator=gen)
    mask = torch.ones_like(prompts)
    mask[1, :4] = 0
    calls = []
    original = mhattn_hf.mhattn.attention

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append((None if attn_mask is None else tuple(attn_mask.shape), kwargs.get("window")))
        return original(query, key, value, attn_mask, *args, **kwargs)

    logits = {}
    for name in ("sdpa", "mhattn"):
        model = tiny_llama(name)
        mhattn_hf.mhattn.attention = spy
        try:
            with torch.no_grad():
                logits[name] = model(prompts, attention_mask=mask).logits[mask.bool()]
        finally:
            mhattn_hf.mhattn.attention = original
    assert calls and all(call == ((2, 1, 1, 9), (-1, 0)) for call in calls), calls
    assert float((logits["mhattn"] - logits["sdpa"]).abs().max()) < 1e-10


def test_decoding_steps_get_one_mask_a_step_for_all_layers():
    """Generation from a left-padded batch: a one-row decoding step gives every layer a (B, 1, 1, Nk) view of the
    step's padding mask (the causal bound hides no key of the last row), so all layers pass the same memory and the
    backends' per-mask work is done once a step; a step of several rows against more keys (speculative decoding,
    a prompt after a cache) gets one (B, 1, Nq, Nk) mask made once for its layers. Tokens and logits as "sdpa"."""
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, 97, (2, 9), generator=gen)
    mask = torch.ones_like(prompts)
    mask[1, :4] = 0
    prompts[1, :4] = 0
    calls, kept = [], []  # (kept: the masks, alive, so that no two share an address by reuse)
    original = mhattn_hf.mhattn.attention

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        kept.append(attn_mask)
        calls.append((query.shape[2], key.shape[2], tuple(attn_mask.shape), attn_mask.data_ptr(), kwargs.get("window")))
        return original(query, key, value, attn_mask, *args, **kwargs)

    mhattn_hf.mhattn.attention = spy
    try:
        tokens = generate(tiny_llama("mhattn"), prompts, mask)
    finally:
        mhattn_hf.mhattn.attention = original
    assert torch.equal(tokens, generate(tiny_llama("sdpa"), prompts, mask))
    steps = [call for call in calls if call[0] == 1]
    assert len(steps) == 2 * 31  # (two layers, the 31 steps after the prompt's)
    for first, second in zip(steps[::2], steps[1::2]):  # (the two layers of one step)
        assert first[2] == (2, 1, 1, first[1]) and first[4] is None and first[3] == second[3]
    # A step of three rows against a cache of 9 keys: one mask for both layers, the bottom-right causal bound in it.
    model = tiny_llama("mhattn")
    calls.clear()
    mhattn_hf.mhattn.attention = spy
    try:
        with torch.no_grad():
            cache = model(prompts, attention_mask=mask, use_cache=True).past_key_values
            more = torch.randint(3, 97, (2, 3), generator=gen)
            longer = torch.cat([mask, torch.ones_like(more)], dim=1)
            logits = model(more, attention_mask=longer, past_key_values=cache).logits
    finally:
        mhattn_hf.mhattn.attention = original
    rows = [call for call in calls if call[0] == 3]
    assert len(rows) == 2 and rows[0][2] == (2, 1, 3, 12) and rows[0][3] == rows[1][3], rows
    with torch.no_grad():
        sdpa = tiny_llama("sdpa")
        want = sdpa(more, attention_mask=longer, past_key_values=sdpa(prompts, attention_mask=mask,
                                                                       use_cache=True).past_key_values).logits
    assert float((logits - want).abs().max()) < 1e-10


def test_whole_model_benchmark_runs_on_tiny_shapes():
    """benchmarks/check_hf_model.py on a tiny model on the CPU: one row per cell, every model running its own
    implementation (the script checks), mhattn's logits within float32 rounding of sdpa's and its first generated
    tokens equal, and a column for the backend forced beside auto."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "check_hf_model.py"
    spec = importlib.util.spec_from_file_location("check_hf_model", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    lines = script.run(torch.device("cpu"), True, 0, 1, ("auto", "reference"))
    assert "mhattn:reference ms" in lines[0] and len(lines) == 5
    rows = {line[:22].strip(): line[22:].split() for line in lines[1:]}
    assert list(rows) == ["train", "train, left-padded", "prefill, left-padded", "decode"]
    for cell, fields in rows.items():
        diff = float(fields[-2] if cell == "decode" else fields[-1])
        assert diff < 1e-5, (cell, fields)
    assert rows["decode"][-1] == "1.000"


def test_hf_model_script_profiles_a_training_step_on_tiny_shapes():
    """check_hf_model.py's --profile on a tiny model on the CPU: before the training row, a line per column with its
    step's time, kernel (here operator) total and launches, then the names in any column's top 3 with each column's
    milliseconds and calls; the operators both columns ran first, with a count in each."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "check_hf_model.py"
    spec = importlib.util.spec_from_file_location("check_hf_model", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    lines = script.run(torch.device("cpu"), True, 0, 1, ("auto", ), only=["train"], profile_top=3)
    assert lines[1].startswith("profile of one training step (CPU ms per step")
    assert lines[2].startswith("  sdpa: step ") and lines[3].startswith("  mhattn: step ")
    assert all("launches" in line and "host syncs" in line for line in lines[2:4])
    assert lines[4].split() == ["kernel", "sdpa", "mhattn"]
    listed = lines[5:-1]
    assert 3 <= len(listed) <= 6 and lines[-1].startswith("train")
    counts = [re.findall(r"\((\s*\d+)\)", line) for line in listed]
    assert len(counts[0]) == 2 and all(int(count) > 0 for count in counts[0])  # shared: counted in both columns


def _sequences(gen, lengths):
    return [torch.randint(3, 97, (n,), generator=gen) for n in lengths]


def padded_loss_and_grads(model, sequences, device):
    longest = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, s in enumerate(sequences):
        input_ids[i, :len(s)], mask[i, :len(s)], labels[i, :len(s)] = s, 1, s
    return _loss_and_grads(model, dict(input_ids=input_ids, attention_mask=mask, labels=labels), device)


def packed_batch(sequences, flash_kwargs):
    """One row of all sequences, as DataCollatorWithFlattening lays it out (the first label of each sequence
    is -100, so no token predicts across a boundary)."""
    input_ids = torch.cat(sequences)[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), s[1:]]) for s in sequences])[None]
    position_ids = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    batch = dict(input_ids=input_ids, labels=labels, position_ids=position_ids)
    if flash_kwargs:
        cu = torch.tensor([0] + torch.tensor([len(s) for s in sequences]).cumsum(0).tolist(), dtype=torch.int32)
        longest = max(len(s) for s in sequences)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return batch


def _loss_and_grads(model, batch, device):
    model.train()
    model.zero_grad()
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def check_packed_training_step(dtype, device, tolerance, flash_kwargs):
    gen = torch.Generator().manual_seed(2)
    sequences = _sequences(gen, (7, 19, 1, 12))
    padded_loss, padded_grads = padded_loss_and_grads(tiny_llama("sdpa", dtype, device), sequences, device)
    model = tiny_llama("mhattn", dtype, device)
    calls = []
    original = mhattn_hf.mhattn.varlen_attention

    def spy(*args, **kwargs):
        calls.append(args[3])
        return original(*args, **kwargs)

    mhattn_hf.mhattn.varlen_attention = spy
    try:
        packed_loss, packed_grads = _loss_and_grads(model, packed_batch(sequences, flash_kwargs), device)
    finally:
        mhattn_hf.mhattn.varlen_attention = original
    assert calls and calls[0].tolist() == [0, 7, 26, 27, 39], "the packed batch must run on varlen_attention"
    assert abs(float(packed_loss) - float(padded_loss)) <= tolerance * abs(float(padded_loss))
    for name, grad in padded_grads.items():
        err = float((packed_grads[name] - grad).abs().max())
        assert err <= tolerance * max(1e-3, float(grad.abs().max())), f"{name}: max error {err}"


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_training_step_matches_padded(flash_kwargs):
    check_packed_training_step(torch.float64, "cpu", 1e-9, flash_kwargs)


def test_unsupported_requests_say_so():
    with pytest.raises(NotImplementedError, match="attention weights"):
        mhattn_hf.attention_forward(None, *(torch.randn(1, 2, 3, 8),) * 3, None, output_attentions=True)
    with pytest.raises(NotImplementedError, match="custom mask functions"):
        mhattn_hf.padding_mask(1, 3, 3, use_vmap=True)


@pytest.mark.gpu
def test_gpu_greedy_generation_matches_sdpa():
    check_generation_matches_sdpa(torch.float32, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_gpu_packed_training_step_matches_padded(flash_kwargs):
    check_packed_training_step(torch.float32, "cuda", 2e-3, flash_kwargs)
