"""A whole Hugging Face model on attn_implementation="mhattn" beside "sdpa": what a user who swaps the attention of a
Llama-shaped model sees, attention's share of the step included.

    source benchmarks/device_env.sh && cd /tmp && python3 <repo>/benchmarks/check_hf_model.py
    python3 benchmarks/check_hf_model.py --tiny --device cpu      # the script itself, on tiny shapes

The model is built from a config (random weights, no downloads): LlamaConfig with hidden 2048, 16 query heads
sharing 4 key/value heads (d = 128), MLP 5632, 12 layers, bf16; both implementations load the same weights. Cells:

- ``train``: a training step's forward and backward of the LM loss on B = 2 sequences of 4096 tokens, no padding;
- ``train, left-padded``: the same on B = 8 sequences of 1024 tokens, each entry's first tokens padding (up to half),
  the attention mask passed as the tokenizer makes it;
- ``prefill, left-padded``: the forward (no gradient, no cache) of B = 8 prompts of 2048 tokens padded on the left;
- ``decode``: greedy generation of 64 tokens from B = 8 prompts of 512 tokens padded on the left, per generated token
  (the prompt's prefill included in the total, which is divided by the new tokens).

"mhattn" runs on automatic selection; ``--backends auto,triton`` adds a column per backend forced with
``mhattn.use_backend`` (the same model). GPU time by CUDA events around each call (warm-up calls first, then the
median of several), so the host's share is in it as a user pays it. For each cell, the largest difference of the
logits between mhattn on auto and sdpa (rows of real tokens) over the largest logit, and for ``decode`` the fraction
of sequences whose first generated token agrees (a random model's next-token distribution is nearly flat, so bf16
rounding flips near-ties, and a greedy continuation differs entirely after its first flip). Prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics

import torch

IMPLEMENTATIONS = ("sdpa", "mhattn")


def build_models(device, dtype, tiny: bool) -> dict:
    """The model once per attention implementation, with the same weights."""
    import transformers

    import mhattn.integrations.transformers as mhattn_hf

    mhattn_hf.register()
    if tiny:
        shape = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
    else:
        shape = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
                     num_attention_heads=16, num_key_value_heads=4)
    config = transformers.LlamaConfig(**shape, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)
    models = {}
    state = None
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        # (a config of its own: from_config records the implementation in the config it is given)
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
        if model.config._attn_implementation != name:
            raise RuntimeError(f"the {name!r} model runs {model.config._attn_implementation!r}")
        model = model.to(device=device, dtype=dtype)
        if state is None:
            state = model.state_dict()
        else:
            model.load_state_dict(state)
        models[name] = model
    return models


def left_padded(batch: int, seqlen: int, vocab: int, device, seed: int) -> tuple:
    """(input_ids, attention_mask) of ``batch`` sequences of ``seqlen`` tokens whose first tokens (up to half, batch
    entry 0 none) are padding, as a tokenizer that pads on the left makes them."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seqlen), generator=gen)
    pads = torch.randint(0, seqlen // 2 + 1, (batch,), generator=gen)
    pads[0] = 0
    mask = (torch.arange(seqlen)[None, :] >= pads[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return ids.to(device), mask.to(device)


def timed_ms(call, device, warmup: int, runs: int) -> float:
    """Median milliseconds of ``call()`` (CUDA events on a GPU, wall time on the CPU) after ``warmup`` calls."""
    import time

    for _ in range(warmup):
        call()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            call()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def training_step(model, ids, mask):
    """Forward and backward of the LM loss (gradients dropped after)."""
    loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.detach()


def logits_of(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False).logits


def profile_lines(models: dict, on, ids, mask, device, top: int) -> list:
    """Where one training step's GPU time goes, per column: the step's time, its kernels' total, then every kernel
    name in any column's ``top`` by time, with its milliseconds and launches per step in each column (the names
    shared by all columns first, so a difference outside attention shows), and the host's synchronizing calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    kernels, steps, syncs = {}, {}, {}
    for name, model in models.items():
        with on(name):
            model.train()
            training_step(model, ids, mask)  # (compiled and cached before the profile)
            steps[name] = timed_ms(lambda: training_step(model, ids, mask), device, 1, 3)
            with profile(activities=activities) as prof:
                training_step(model, ids, mask)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            model.eval()
        events = prof.key_averages()
        on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        if device.type != "cuda":  # (the CPU: the operators stand for the kernels)
            on_gpu = [e for e in events if e.key.startswith("aten::")]
        kernels[name] = {e.key: ((e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total) / 1e3,
                                 e.count) for e in on_gpu}
        syncs[name] = sum(e.count for e in events
                          if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                                       "aten::item", "aten::_local_scalar_dense"))
    names = list(models)
    lines = [f"profile of one training step ({'GPU' if device.type == 'cuda' else 'CPU'} ms per step; launches)"]
    for name in names:
        lines.append(f"  {name}: step {steps[name]:.2f} ms, kernels {sum(t for t, _ in kernels[name].values()):.2f} ms "
                     f"in {sum(c for _, c in kernels[name].values())} launches, {syncs[name]} host syncs")
    shown = []
    for name in names:
        for key, _ in sorted(kernels[name].items(), key=lambda item: -item[1][0])[:top]:
            if key not in shown:
                shown.append(key)
    shared = [key for key in shown if all(key in kernels[name] for name in names)]
    lines.append(f"  {'kernel':<64} " + " ".join(f"{name[:18]:>26}" for name in names))
    for key in shared + [key for key in shown if key not in shared]:
        cells = []
        for name in names:
            ms, count = kernels[name].get(key, (0.0, 0))
            cells.append(f"{ms:>17.2f} ({count:>5})" if count else f"{'-':>26}")
        lines.append(f"  {key[:64]:<64} " + " ".join(cells))
    return lines


def run(device, tiny: bool, warmup: int, runs: int, backends=("auto", ), only=None, profile_top: int = 0) -> list:
    import mhattn

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    built = build_models(device, dtype, tiny)
    # column -> (model, the mhattn backend its calls are forced onto, or None)
    columns = {"sdpa": (built["sdpa"], None)}
    for backend in backends:
        columns["mhattn" if backend == "auto" else f"mhattn:{backend}"] = (built["mhattn"], backend)

    def on(column):
        backend = columns[column][1]
        return contextlib.nullcontext() if backend is None else mhattn.use_backend(backend)

    models = {name: model for name, (model, _) in columns.items()}
    vocab = models["sdpa"].config.vocab_size
    small = tiny or device.type == "cpu"
    cells = {
        "train": (1, 64) if small else (2, 4096),
        "train, left-padded": (2, 48) if small else (8, 1024),
        "prefill, left-padded": (2, 64) if small else (8, 2048),
        "decode": (2, 16) if small else (8, 512),
    }
    if only:
        cells = {name: shape for name, shape in cells.items() if name in only}
    new_tokens = 8 if small else 64
    others = [name for name in columns if name != "sdpa"]
    lines = [f"{'cell':<22} {'B':>3} {'N':>5} {'sdpa ms':>9} " + " ".join(f"{name + ' ms':>16}" for name in others)
             + " " + " ".join(f"{'x ' + name:>14}" for name in others) + f" {'logit diff':>11} {'first tokens':>13}"]
    for cell, (batch, seqlen) in cells.items():
        if cell == "train":
            ids = torch.randint(3, vocab, (batch, seqlen), generator=torch.Generator().manual_seed(5)).to(device)
            mask = torch.ones_like(ids)
        else:
            ids, mask = left_padded(batch, seqlen, vocab, device, seed=seqlen + batch)
        real = mask.bool()
        if profile_top and cell.startswith("train"):
            lines += profile_lines(models, on, ids, mask, device, profile_top)
        out = {}
        for name in ("sdpa", "mhattn"):
            with on(name):
                out[name] = logits_of(models[name], ids, mask)[real].float()
        diff = float((out["mhattn"] - out["sdpa"]).abs().max() / out["sdpa"].abs().max())
        agree = ""
        ms = {}
        for name, model in models.items():
            def generate():
                with torch.no_grad():
                    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                          min_new_tokens=new_tokens, do_sample=False)

            with on(name):
                if cell.startswith("train"):
                    model.train()
                    ms[name] = timed_ms(lambda: training_step(model, ids, mask), device, warmup, runs)
                    model.eval()
                elif cell.startswith("prefill"):
                    ms[name] = timed_ms(lambda: logits_of(model, ids, mask), device, warmup, runs)
                else:
                    ms[name] = timed_ms(generate, device, 1, max(1, runs // 2)) / new_tokens
                    if name in ("sdpa", "mhattn"):
                        out[name] = generate()[:, seqlen:]
        for name, model in models.items():  # (each model ran its own attention)
            assert model.config._attn_implementation == name.split(":")[0], (name, model.config._attn_implementation)
        if cell == "decode":
            agree = f"{float((out['mhattn'][:, 0] == out['sdpa'][:, 0]).float().mean()):.3f}"
        lines.append(f"{cell:<22} {batch:>3} {seqlen:>5} {ms['sdpa']:>9.2f} "
                     + " ".join(f"{ms[name]:>16.2f}" for name in others) + " "
                     + " ".join(f"{ms['sdpa'] / ms[name]:>13.2f}x" for name in others)
                     + f" {diff:>11.1e} {agree:>13}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and shapes (to test the script on the CPU)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up calls per timing (default 2)")
    parser.add_argument("--runs", type=int, default=5, help="timed calls per timing, their median kept (default 5)")
    parser.add_argument("--cells", default="",
                        help="only these cells, comma-separated: train, train-padded, prefill, decode (default all)")
    parser.add_argument("--backends", default="auto",
                        help="mhattn's columns: auto and/or backends forced by name (default auto; e.g. auto,triton)")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="before each training cell's row, a torch.profiler listing of one step per column: the "
                             "TOP kernels by GPU time of each (default 0: none)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; the decode row's times are per "
          "generated token", flush=True)
    backends = tuple(name.strip() for name in args.backends.split(",") if name.strip())
    if "auto" not in backends:
        backends = ("auto", ) + backends  # (the logits are compared on auto)
    names = {"train": "train", "train-padded": "train, left-padded", "prefill": "prefill, left-padded",
             "decode": "decode"}
    only = [names[name.strip()] for name in args.cells.split(",") if name.strip()] or None
    for line in run(device, args.tiny, args.warmup, args.runs, backends, only, args.profile):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
