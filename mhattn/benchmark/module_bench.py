"""A training step of a small Transformer encoder, with torch's and mhattn's MultiheadAttention.

The model: ``layers`` pre-LayerNorm encoder blocks (self-attention, then a GELU MLP of 4 * d_model),
float32 weights, run under bf16 autocast with AdamW; one step = zero_grad, forward, a mean-square loss,
backward, optimizer step. The same model is built (same seed) with ``torch.nn.MultiheadAttention`` and
with ``mhattn.MultiheadAttention`` (through ``mhattn.replace_multihead_attention`` where it exists). Each
step moves ``tokens`` tokens (batch = tokens / N). Reported: milliseconds per step, tokens per second
and the peak memory allocated during the timed steps (weights, gradients and optimizer state included).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from mhattn.benchmark.timing import describe_error, release_memory

SEQLENS = (1024, 2048, 4096, 8192)
TORCH_VARIANT = "torch"
MHATTN_VARIANT = "mhattn"   # "mhattn" = automatic backend choice; "mhattn:<name>" = that backend


@dataclass(frozen=True)
class ModuleConfig:
    layers: int = 12
    d_model: int = 768
    heads: int = 12
    tokens: int = 16384
    steps: int = 10
    warmup_steps: int = 3

    def batch(self, seqlen: int) -> int:
        return max(1, self.tokens // seqlen)

    def as_dict(self) -> dict:
        return asdict(self)


class EncoderBlock(nn.Module):
    """x (B, N, d_model) -> x + attn(norm(x)) -> + mlp(norm(.)). ``attention`` is any module with
    torch.nn.MultiheadAttention's call signature, built with batch_first=True."""

    def __init__(self, attention: nn.Module, d_model: int):
        super().__init__()
        self.norm_attn = nn.LayerNorm(d_model)
        self.attn = attention
        self.norm_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        h = self.norm_attn(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm_mlp(x))


class Encoder(nn.Module):
    def __init__(self, config: ModuleConfig):
        super().__init__()
        self.blocks = nn.ModuleList(
            EncoderBlock(nn.MultiheadAttention(config.d_model, config.heads, dropout=0.0, batch_first=True),
                         config.d_model)
            for _ in range(config.layers)
        )
        self.norm = nn.LayerNorm(config.d_model)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class VariantUnavailable(Exception):
    """The variant cannot be built in this installation (e.g. mhattn.MultiheadAttention missing)."""


def _swap_to_mhattn(model: nn.Module, config: ModuleConfig) -> nn.Module:
    import mhattn

    replace = getattr(mhattn, "replace_multihead_attention", None)
    module_class = getattr(mhattn, "MultiheadAttention", None)
    if replace is not None:
        result = replace(model)
        model = result if isinstance(result, nn.Module) else model
    elif module_class is not None:
        for block in model.blocks:
            swapped = module_class(config.d_model, config.heads, dropout=0.0, batch_first=True)
            swapped.load_state_dict(block.attn.state_dict())
            block.attn = swapped
    else:
        raise VariantUnavailable("mhattn has neither MultiheadAttention nor replace_multihead_attention in this build")
    left = sum(type(m) is nn.MultiheadAttention for m in model.modules())
    if left:
        raise VariantUnavailable(f"after the swap {left} torch.nn.MultiheadAttention modules are left in the model")
    return model


def build_model(config: ModuleConfig, variant: str, device) -> nn.Module:
    torch.manual_seed(0)
    model = Encoder(config)
    if variant != TORCH_VARIANT:
        model = _swap_to_mhattn(model, config)
    return model.to(device)


def backend_context(variant: str):
    """The context a variant's steps run in: ``mhattn.use_backend(name)`` for 'mhattn:<name>'."""
    import contextlib

    if variant.startswith(MHATTN_VARIANT + ":"):
        import mhattn

        return mhattn.use_backend(variant.split(":", 1)[1])
    return contextlib.nullcontext()


def module_row(variant: str, seqlen: int, config: ModuleConfig) -> dict:
    return {
        "kind": "module",
        "variant": variant,
        "n": seqlen,
        "batch": config.batch(seqlen),
        "precision": "bf16 autocast, fp32 weights, AdamW",
        **{k: v for k, v in config.as_dict().items() if k != "tokens"},
        "step_ms": None,
        "tokens_per_s": None,
        "peak_bytes": None,
        "loss": None,
        "status": "skipped",
    }


def measure_training_step(variant: str, seqlen: int, config: ModuleConfig, device) -> dict:
    """Time ``config.steps`` training steps of the encoder built as ``variant`` at sequence length ``seqlen``.

    Never raises for a failure of the variant: ``status`` is 'ok', 'n/a: ...', 'OOM' or 'error: ...'.
    """
    row = module_row(variant, seqlen, config)
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    model = optimizer = x = None
    try:
        model = build_model(config, variant, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        generator = torch.Generator(device=device).manual_seed(seqlen)
        x = torch.randn(config.batch(seqlen), seqlen, config.d_model, device=device, generator=generator)

        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            return loss

        with backend_context(variant):
            for _ in range(config.warmup_steps):
                loss = step()
            _sync(device)
            if on_cuda:
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            for _ in range(config.steps):
                loss = step()
            _sync(device)
            elapsed = time.perf_counter() - start
        loss_value = float(loss.item())
        step_ms = elapsed * 1e3 / config.steps
        row.update(step_ms=step_ms, tokens_per_s=config.batch(seqlen) * seqlen / (step_ms * 1e-3),
                   loss=loss_value if math.isfinite(loss_value) else None,
                   peak_bytes=int(torch.cuda.max_memory_allocated(device)) if on_cuda else None,
                   status="ok" if math.isfinite(loss_value) else f"error: non-finite loss {loss_value}")
    except VariantUnavailable as error:
        row["status"] = f"n/a: {error}"
    except Exception as error:  # report, never crash the sweep
        row["status"] = describe_error(error)
    finally:
        model = optimizer = x = None
        release_memory(device)
    return row


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
