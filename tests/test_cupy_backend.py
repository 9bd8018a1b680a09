"""Tests of the CUDA C++ backend (mhattn.backends.cupy).

CPU (CI):
- test_nvrtc_*: NVRTC compiles every kernel variant for sm_80 and sm_90 to a cubin (all variants in
  parallel processes, about a minute on two cores). This is CI's check that the CUDA sources compile.
- capabilities, reasons, tile tables.
- test_emulated_*: the kernels run on the CPU through the host-side emulator of their PTX layer (needs a
  C++ compiler) and are held to the conformance tolerance: index arithmetic, masking and pipelining.

GPU (@pytest.mark.gpu, H100 in practice): every feature against the reference with the conformance rule,
outputs poisoned with NaN, dropout keep-mask equality with mhattn.dropout_rng, deterministic backward,
torch stream / CUDA graph / CuPy memory pool behaviour, and the path through mhattn.attention.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from mhattn.backends.base import AttentionParams
from mhattn.backends.cupy import CupyBackend, ops, variants
from mhattn.conformance.tolerance import compare
from mhattn.dropout_rng import keep_mask
from mhattn.problem import Problem
from mhattn.reference.naive import naive_attention

ARCHS = ("sm_80", "sm_90")
KERNELS = ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dkdv_2d", "bwd_dq", "kv_combine", "kv_append")
# (compile target, kernel) pairs CI compiles: every kernel for each architecture, the Hopper family for sm_90a.
COMPILED = tuple((arch, kernel) for arch in ARCHS for kernel in KERNELS) + (("sm_90a", "hopper_fwd"),
                                                                             ("sm_90a", "hopper_bwd"))


def _nvrtc_missing():
    try:
        from mhattn.backends.cupy import compiler

        compiler.nvrtc_version()
    except Exception as error:  # cupy or NVRTC not installed
        return f"NVRTC not available: {type(error).__name__}: {error}"
    return None


needs_nvrtc = pytest.mark.skipif(_nvrtc_missing() is not None, reason=str(_nvrtc_missing()))


# ---- CPU: the sources compile --------------------------------------------------------------------------------


def _compile(task):
    """(error or None, ptxas's wgmma notes) of one variant's compilation."""
    variant, cc = task
    from mhattn.backends import ptxas_notes
    from mhattn.backends.cupy import compiler

    try:
        log = []
        cubin = compiler.compile_cubin(variant, cc, ptxas_log=log)
        assert cubin[:4] == b"\x7fELF", "NVRTC returned something other than an ELF cubin"
        notes = ptxas_notes.wgmma_notes(log[0])
        return None, [f"{compiler.target_name(variant, cc)} {variant.label}: {note}" for note in notes]
    except Exception as error:
        return f"{compiler.target_name(variant, cc)} {variant.label}: {error}", []


def feature_variant_sample(cc) -> list:
    """The feature variants CI compiles (mhattn build compiles all of them: about 3x as many variants as the
    rest): every feature set at the one-dimensional dK/dV buckets (32, 64), all flags at once at every bucket."""
    out = [variants.preprocess_variant(dtype, any_dims=True) for dtype in variants.DTYPE_NAMES]
    for flags in variants.FEATURE_SETS:
        buckets = variants.HEAD_DIM_BUCKETS if len(flags) == len(variants.FEATURE_FLAGS) else (32, 64)
        for i, d in enumerate(buckets):
            dtype = variants.DTYPE_NAMES[i % 2]  # both dtypes over the buckets
            out.extend(variants.kernel_variants(cc, dtype, d, "full", features=flags))
    return out


def sequence_variant_sample(cc) -> list:
    """The per-sequence variants CI compiles (mhattn build compiles all of them): the varlen preprocess, the split-KV
    combine, the KV cache's append, and every varlen and KV-cache kernel (both caches, with and without KV_SPLIT) at
    the "bounds" level at d = 64 and with every flag they take at d = 128 (the 2-D dK/dV kernel)."""
    out = [variants.preprocess_variant(dtype, any_dims=any_dims, varlen=True) for dtype in variants.DTYPE_NAMES
           for any_dims in (False, True)]
    out += [variants.combine_variant(dtype) for dtype in variants.DTYPE_NAMES]
    out += [variants.append_variant(dtype) for dtype in variants.DTYPE_NAMES]
    flags = variants.SEQUENCE_FEATURE_SETS[-1]
    out.extend(v for v in variants.sequence_variants(cc, "float16", 64)
               if dict(v.defines)["HAS_BOUNDS"] and not dict(v.defines)["HAS_EXTRAS"])
    out.extend(v for v in variants.sequence_variants(cc, "bfloat16", 128) if all(dict(v.defines).get(f) for f in flags))
    return out


def hopper_options_off_in_the_tables() -> list:
    """The Hopper variants with each option the other way from the tables (so CI compiles them too): dQ by the
    copy engine's bulk reduce-add or by atomics in the backward, two dQ buffers at d = 64, dQ in turns (reproducible)
    where the table keeps the mma.sync dQ kernel for it, the other step height at d = 64 (with each feature); the
    output staged for the copy engine or stored by the consumers in the forward (staged only where it fits), its
    output rescaled lazily or at every block (with and without a mask and a softcap), and its ping-pong turns reset
    at every tile or running on across tiles."""
    out = [variants.hopper_bwd_variant(dtype, d, variants.HopperBwdTiles(tiles.stages, not tiles.dq_bulk))
           for dtype in variants.DTYPE_NAMES for d, tiles in variants.HOPPER_BWD_TILES.items()]
    stages_64 = variants.HOPPER_BWD_TILES[64].stages
    out += [variants.hopper_bwd_variant(dtype, 64, variants.HopperBwdTiles(stages_64, bulk, 2))
            for dtype in variants.DTYPE_NAMES for bulk in (False, True)]  # two dQ buffers (room at d = 64 only)
    out += [variants.hopper_bwd_variant(dtype, d, deterministic=True) for dtype in variants.DTYPE_NAMES
            for d in variants.HOPPER_BWD_TILES if d not in variants.HOPPER_BWD_DETERMINISTIC_DIMS]  # dQ in turns
    rows_64 = 192 - variants.HOPPER_BWD_TILES[64].query_rows  # the other step height at d = 64 (64 or 128 queries)
    out += [variants.hopper_bwd_variant(dtype, 64, variants.HopperBwdTiles(2, False, 1, rows_64), **f)
            for dtype in variants.DTYPE_NAMES
            for f in (dict(), dict(softcap=True), dict(bool_mask=True), dict(float_mask=True), dict(deterministic=True))]
    for dtype in variants.DTYPE_NAMES:
        for d, tiles in variants.HOPPER_FWD_TILES.items():
            other = dataclasses.replace(tiles, staged_out=not tiles.staged_out)
            if variants.hopper_fwd_smem(other, d) <= variants.smem_limit(variants.HOPPER_CC):
                out.append(variants.hopper_fwd_variant(dtype, d, other))
            lazy = dataclasses.replace(tiles, lazy_rescale=not tiles.lazy_rescale)
            out += [variants.hopper_fwd_variant(dtype, d, lazy, masked=masked, softcap=softcap)
                    for masked in (False, True) for softcap in (False, True)]
            if tiles.pingpong:  # the turns reset at every tile or running on across tiles
                turns = dataclasses.replace(tiles, turns_across_tiles=not tiles.turns_across_tiles)
                out += [variants.hopper_fwd_variant(dtype, d, turns, softcap=softcap) for softcap in (False, True)]
    return out


@pytest.fixture(scope="module")
def compile_failures():
    """Compile every variant without feature flags and a sample of those with them (feature_variant_sample,
    sequence_variant_sample) for every architecture once (in parallel); ((arch, kernel) -> failures, (arch, kernel) ->
    variants compiled, (arch, kernel) -> ptxas's wgmma notes)."""
    from mhattn.backends.cupy import compiler

    tasks = [(v, variants.parse_arch(arch)) for arch in ARCHS
             for v in variants.all_variants(variants.parse_arch(arch), features=False, sequences=False)
             + feature_variant_sample(variants.parse_arch(arch)) + sequence_variant_sample(variants.parse_arch(arch))]
    tasks += [(v, variants.HOPPER_CC) for v in variants.hopper_variants() + hopper_options_off_in_the_tables()]
    jobs = max(1, min(len(tasks), os.cpu_count() or 1))
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(_compile, tasks, chunksize=4))
    out = {key: [] for key in COMPILED}
    counts = dict.fromkeys(out, 0)
    notes = {key: [] for key in COMPILED}
    for (variant, cc), (error, variant_notes) in zip(tasks, results):
        key = (compiler.target_name(variant, cc), variant.kernel)
        counts[key] += 1
        notes[key] += variant_notes
        if error:
            out[key].append(error)
    return out, counts, notes


@needs_nvrtc
@pytest.mark.parametrize("arch, kernel", COMPILED)
def test_nvrtc_compiles_every_variant(compile_failures, arch, kernel):
    failures, counts, _ = compile_failures
    assert counts[(arch, kernel)] > 0
    assert not failures[(arch, kernel)], "\n\n".join(failures[(arch, kernel)])


@needs_nvrtc
@pytest.mark.parametrize("kernel", ["hopper_fwd", "hopper_bwd"])
def test_hopper_kernels_keep_their_products_in_flight(compile_failures, kernel):
    """ptxas leaves the wgmma of every Hopper variant asynchronous: no note that it serialised them or injected a
    wait (a forward built so ran at three quarters of its speed on the H100, backends/cupy/NOTES.md)."""
    failures, counts, notes = compile_failures
    assert counts[("sm_90a", kernel)] > 0 and not failures[("sm_90a", kernel)]
    assert not notes[("sm_90a", kernel)], "\n".join(notes[("sm_90a", kernel)])


@needs_nvrtc
def test_build_cli_lists_and_rejects_bad_arch(capsys):
    from mhattn.cli import main

    assert main(["build", "--arch", "sm_90", "--list"]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    assert len(listed) == len(variants.all_variants((9, 0)))
    assert main(["build", "--arch", "sm_90a", "--list"]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    assert len(listed) == len(variants.hopper_variants()) and all(line.startswith(("sm_90a  hopper_fwd@a[",
                                                                                    "sm_90a  hopper_bwd@a["))
                                                                  for line in listed)
    assert main(["build", "--arch", "hopper"]) == 2
    assert main(["build", "--arch", "sm_80a"]) == 2


@needs_nvrtc
def test_compile_error_names_the_variant():
    from mhattn.backends.cupy import compiler

    variant = variants.fwd_variant((9, 0), "bfloat16", 64, "plain")
    defines = tuple((k, 48 if k == "HEAD_DIM" else v) for k, v in variant.defines)  # not a multiple of 32
    broken = variants.Variant(variant.kernel, defines, variant.num_threads, 0)
    with pytest.raises(compiler.KernelCompileError, match="fwd\\[.*sm_90"):
        compiler.compile_cubin(broken, (9, 0), ptx_only=True)


# ---- CPU: capabilities and reasons ---------------------------------------------------------------------------


def _problem(**kw):
    base = dict(device_type="cuda", device_index=0, compute_capability=(9, 0), dtype=torch.bfloat16, batch=2,
                heads_q=8, heads_kv=8, seqlen_q=1024, seqlen_k=1024, head_dim=128, head_dim_v=128,
                features=frozenset())
    base.update(kw)
    return Problem(**base)


def test_capabilities_are_data_and_reasons_are_sentences(monkeypatch):
    backend = CupyBackend()
    monkeypatch.setattr(backend, "unavailable", lambda: [])
    caps = backend.capabilities
    # every feature the base contract names (what the Triton backend declares too)
    from mhattn.backends.base import FEATURES

    assert caps.features == set(FEATURES)
    assert caps.dtypes == {torch.float16, torch.bfloat16} and (caps.min_head_dim, caps.max_head_dim) == (1, 256)
    assert backend.unsupported(_problem(features=frozenset(FEATURES) - {"value_dim"})) == []
    for head_dim, head_dim_v in ((40, 40), (59, 59), (1, 256), (256, 3)):
        features = frozenset({"value_dim"}) if head_dim != head_dim_v else frozenset()
        assert backend.unsupported(_problem(head_dim=head_dim, head_dim_v=head_dim_v, features=features)) == []
    cases = {
        "head dims": _problem(head_dim=320),
        "value head dims": _problem(head_dim_v=320, features=frozenset({"value_dim"})),
        "dtypes": _problem(dtype=torch.float32),
        "compute capability": _problem(compute_capability=(7, 5)),
        "runs on": _problem(device_type="cpu", compute_capability=None),
        "sequences up to": _problem(seqlen_k=ops.MAX_SEQLEN + 1),
        "grid y/z": _problem(batch=70000),
        "forward grid": _problem(batch=4096, heads_q=4096, seqlen_q=1 << 20),
    }
    for words, problem in cases.items():
        reasons = backend.unsupported(problem)
        assert any(words in r for r in reasons), (words, reasons)


def test_tiles_fit_shared_memory_and_registers_rules():
    for cc in ((8, 0), (8, 6), (8, 9), (9, 0)):
        limit = variants.smem_limit(cc)
        for d in variants.HEAD_DIM_BUCKETS:
            fwd, fwd_bounded = variants.fwd_tiles(cc, d), variants.fwd_tiles(cc, d, "bounds")
            dkdv = variants.dkdv_tiles(cc, d)
            dq = variants.dq_tiles(cc, d)
            assert variants.fwd_smem(fwd, d) <= limit and variants.dq_smem(dq, d) <= limit
            assert variants.fwd_smem(fwd_bounded, d) <= limit and fwd_bounded.block_m // fwd_bounded.num_warps in (16, 32)
            assert fwd.block_m // fwd.num_warps in (16, 32) and fwd.block_n % 16 == 0
            assert min(fwd.block_m, fwd_bounded.block_m) >= ops.MIN_FWD_BLOCK_M  # the forward grid bound
            assert dq.block_m // dq.num_warps in (16, 32)
            assert ops.VECTOR_PAD % dq.block_m == 0
            for atomic in (False, True):
                dkdv = variants.dkdv_tiles(cc, d, atomic)
                assert variants.dkdv_smem(dkdv, d, True) <= limit, (cc, d, dkdv)
                assert ops.VECTOR_PAD % dkdv.block_m == 0
                if isinstance(dkdv, variants.Dkdv2dTiles):
                    assert variants.dkdv_2d_problems(dkdv, d) == []
                else:
                    assert dkdv.block_n // dkdv.num_warps in (16, 32)


def test_two_dimensional_tiles_are_checked_and_fall_back_where_they_do_not_fit(monkeypatch):
    bad = variants.Dkdv2dTiles(128, 64, 8, 3, 4, 2, False)  # 8 warps do not split into 3 rows of warps
    assert any("s_warps_n=3" in p for p in variants.dkdv_2d_problems(bad, 128))
    with pytest.raises(ValueError, match="s_warps_n=3"):
        variants.dkdv_variants((9, 0), "bfloat16", 128, "plain", tiles=bad)
    big = variants.Dkdv2dTiles(128, 64, 8, 4, 4, 2, False)  # 173 KiB with P^T and dS^T: over an A100's 163
    monkeypatch.setitem(variants.DKDV_TILES, 128, big)
    assert variants.dkdv_tiles((9, 0), 128) == big
    assert variants.dkdv_tiles((8, 0), 128) == variants.DKDV_FALLBACK_TILES[128]
    [variant] = variants.dkdv_variants((9, 0), "float16", 128, "bounds", atomic_dq=False)
    assert variant.kernel == "bwd_dkdv_2d" and variant.define("DKDV_MODE") == 0
    assert variant.smem_bytes == variants.dkdv_smem(big, 128) <= variants.smem_limit((9, 0))
    assert variants.dkdv_tiles_from_fields(128, 64, 8, 4, 4, 2, False) == variants.Dkdv2dTiles(128, 64, 8, 4, 4, 2, False)
    with pytest.raises(ValueError, match="5 fields"):
        variants.dkdv_tiles_from_fields(1, 2, 3)
    assert [variants.head_dim_bucket(d) for d in (8, 16, 40, 64, 80, 96, 128, 160, 224, 256)] == \
        [32, 32, 64, 64, 96, 96, 128, 192, 256, 256]
    assert variants.parse_arch("sm_90") == (9, 0) and variants.parse_arch("8.6") == (8, 6)


def test_feature_flags_pick_variants_and_leave_the_others_alone():
    params = _params(64, 64, 64)
    assert ops.feature_flags(params, 64, 64) == () and ops.level_of(params) == "plain"
    # without flags a variant's -D options (so its code) are those it had before the flags existed
    for v in variants.all_variants((9, 0), features=False, sequences=False):
        assert not set(dict(v.defines)) & set(variants.FEATURE_FLAGS), v.label
    float_mask = torch.zeros(1, 1, 64, 64).expand(2, 3, 64, 64)
    assert ops.feature_flags(params.replace(softcap=30.0), 64, 64) == ("SOFTCAP",)
    assert ops.feature_flags(params.replace(mask=float_mask), 64, 64) == ("FLOAT_MASK",)
    assert ops.feature_flags(params.replace(mask=float_mask.bool()), 64, 64) == ()
    assert ops.feature_flags(params, 64, 32) == ("ANY_DIMS",) and ops.feature_flags(params, 59, 59) == ("ANY_DIMS",)
    flags = ops.feature_flags(params.replace(softcap=5.0, mask=float_mask), 20, 36)
    assert flags == ("SOFTCAP", "FLOAT_MASK", "ANY_DIMS") and ops.level_of(params, flags) == "full"
    variant = variants.fwd_variant((9, 0), "float16", 64, "full", features=flags)
    assert [variant.define(f) for f in flags] == [1, 1, 1]
    with pytest.raises(ValueError, match="'full' level"):
        variants.fwd_variant((9, 0), "float16", 64, "bounds", features=("SOFTCAP",))
    with pytest.raises(ValueError, match="SOFTCAPS"):
        variants.dq_variant((9, 0), "float16", 64, "full", features=("SOFTCAPS",))
    # a broadcast float mask is converted to float32 without materialising the broadcast
    view = ops.float_mask_view(torch.randn(1, 1, 64, 64).half().expand(2, 3, 64, 64))
    assert view.dtype == torch.float32 and view.shape == float_mask.shape and view.stride()[:2] == (0, 0)
    assert len(variants.all_variants((9, 0), sequences=False)) == len(
        variants.all_variants((9, 0), features=False, sequences=False)) + 2 + sum(
        len(variants.kernel_variants((9, 0), dt, d, "full", features=f))
        for dt in variants.DTYPE_NAMES for d in variants.HEAD_DIM_BUCKETS for f in variants.FEATURE_SETS)


def test_registered_under_its_name():
    from mhattn import registry

    assert type(registry.get_backend("cupy")).__name__ == "CupyBackend"


# ---- shared checking helpers (CPU emulator and GPU) ---------------------------------------------------------


def _inputs(batch, heads_q, heads_kv, seqlen_q, seqlen_k, d, dtype, device, strided=False, seed=0, d_v=None):
    """q, k (head dim d), v and grad_out (head dim d_v, default d); strided: views of one packed projection."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    d_v = d if d_v is None else d_v

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    if strided:  # views of one packed (B, N, Hq + 2 Hkv, d) projection, as MultiheadAttention makes them
        assert seqlen_q == seqlen_k and d_v == d
        packed = randn(batch, seqlen_q, heads_q + 2 * heads_kv, d)
        q = packed[:, :, :heads_q].transpose(1, 2)
        k = packed[:, :, heads_q:heads_q + heads_kv].transpose(1, 2)
        v = packed[:, :, heads_q + heads_kv:].transpose(1, 2)
    else:
        q = randn(batch, heads_q, seqlen_q, d)
        k = randn(batch, heads_kv, seqlen_k, d)
        v = randn(batch, heads_kv, seqlen_k, d_v)
    grad_out = randn(batch, heads_q, seqlen_q, d_v)
    return q, k, v, grad_out


def _reference_grads(q, k, v, grad_out, params, dtype, grad_lse=None):
    """out, lse, dq, dk, dv (and dmask for a float mask that requires grad) of naive attention computed in
    ``dtype`` with torch autograd."""
    qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    mask = None
    if params.mask_requires_grad:  # a leaf of the broadcast shape: its gradient is dS itself
        mask = params.mask.detach().to(dtype).contiguous().requires_grad_()
    out, lse = naive_attention(qq, kk, vv, params, mask=mask)
    loss = (out * grad_out.to(dtype)).sum()
    if grad_lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * grad_lse.to(dtype)).sum()
    loss.backward()
    grads = (out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad)
    return grads + (mask.grad,) if mask is not None else grads


def _check(backend, q, k, v, grad_out, params, grad_lse=None):
    """Runs the backend forward and backward and returns the comparisons that failed (empty = pass)."""
    dtype = q.dtype
    out, lse = backend.forward(q, k, v, params)
    dq, dk, dv, dmask = backend.backward(grad_out, q, k, v, out, lse, params, grad_lse=grad_lse)
    got = (out, lse, dq, dk, dv)
    if params.mask_requires_grad:
        assert dmask is not None and dmask.dtype == params.mask.dtype
        got += (dmask,)
    else:
        assert dmask is None
    gold = _reference_grads(q, k, v, grad_out, params, torch.float64, grad_lse)
    lowp = _reference_grads(q, k, v, grad_out, params, dtype, grad_lse)
    names = ("out", "lse", "dq", "dk", "dv", "dmask")
    results = [compare(name, x, g, lp, dtype=dtype) for name, x, g, lp in zip(names, got, gold, lowp)]
    return [str(r) for r in results if not r.ok]


def _params(seqlen_q, seqlen_k, d, causal=None, window=None, mask=None, dropout_p=0.0, seed=(0, 0), softcap=None,
            mask_requires_grad=False):
    """causal: None, "top_left" or "bottom_right"; window: (left, right) around the same diagonal."""
    offset = seqlen_k - seqlen_q if causal == "bottom_right" else 0
    left, right = window if window is not None else (None, None)
    if causal is not None:
        right = 0 if right is None else min(right, 0)
    return AttentionParams(scale=1.0 / math.sqrt(d), diag_offset=offset, window_left=left, window_right=right,
                           mask=mask, dropout_p=dropout_p, seed=seed, softcap=softcap,
                           mask_requires_grad=mask_requires_grad)


def _float_mask(batch, heads, seqlen_q, seqlen_k, dtype, device, seed=5):
    """An additive float mask (B, 1, Nq, Nk) broadcast over the heads: random values, -inf in a quarter of
    the places and on all of row 3 (a row that sees nothing)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, 1, seqlen_q, seqlen_k, generator=gen)
    values[torch.rand(values.shape, generator=gen) < 0.25] = float("-inf")
    values[:, :, 3] = float("-inf")
    return values.to(dtype=dtype, device=device).expand(batch, heads, seqlen_q, seqlen_k)


# ---- CPU: the kernels under the emulator -----------------------------------------------------------------------


def _emulator_missing():
    try:  # the emulator lives in the source tree (backends/cupy/emulator), not in a wheel
        from mhattn.backends.cupy.emulator import host_compiler
    except ImportError as error:
        return f"kernel emulator not importable: {error}"
    return None if host_compiler() else "no host C++ compiler for the kernel emulator"


# Bounds::whole_blocks / whole_row_blocks (common.cuh) against Bounds::block_inside, which they turn into a range of
# blocks once per tile in the Hopper kernels: a program of the header, built by the host compiler, tries every block
# of sequences up to 700 rows under causal, window and unbounded bands and prints its mismatches.
BLOCK_RANGES_PROGRAM = r"""
#include <cstdio>
int main() {
  const int U = 1 << 30;  // an unbounded side, as ops.UNBOUNDED
  const int sides[] = {U, 0, 1, 63, 64, 65, 100, 300};
  const int lengths[] = {1, 63, 64, 65, 200, 700};
  long bad = 0, checked = 0;
  for (int diag = -300; diag <= 300; diag += 7)
    for (int left : sides)
      for (int right : sides) {
        const Bounds b{diag, left, right};
        for (int seqlen_k : lengths)
          for (int i0 = 0; i0 < 704; i0 += 64) {
            int lo, hi;
            b.whole_blocks<64>(i0, i0 + 63, seqlen_k, lo, hi);
            for (int j = 0; j * 64 < seqlen_k; ++j, ++checked) {
              const bool whole = j * 64 + 64 <= seqlen_k && b.block_inside(i0, i0 + 63, j * 64, j * 64 + 63);
              bad += whole != (lo <= j && j < hi);
            }
          }
        for (int j0 = 0; j0 < 704; j0 += 64) {
          int lo, hi;
          b.whole_row_blocks<64>(j0, j0 + 63, lo, hi);
          for (int m = 0; m < 12; ++m, ++checked)
            bad += b.block_inside(m * 64, m * 64 + 63, j0, j0 + 63) != (lo <= m && m < hi);
        }
      }
  std::printf("%ld mismatches in %ld blocks\n", bad, checked);
  return bad != 0;
}
"""


def test_band_block_ranges_match_block_inside(tmp_path):
    if _emulator_missing():
        pytest.skip(_emulator_missing())
    from mhattn.backends.cupy import compiler
    from mhattn.backends.cupy.emulator import HERE, host_compiler

    source = tmp_path / "block_ranges.cpp"
    source.write_text('#include "emulator.h"\n' + compiler.expand_source("common.cuh") + BLOCK_RANGES_PROGRAM)
    program = tmp_path / "block_ranges"
    build = subprocess.run([host_compiler(), "-std=c++17", "-O1", "-w", f"-I{HERE}", "-DHEAD_DIM=64", "-DNUM_WARPS=4",
                            "-DMHATTN_BF16=1", str(source), "-o", str(program)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(program)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout
    assert run.stdout.startswith("0 mismatches in ")


@pytest.fixture(scope="module")
def emulated_backend():
    if _emulator_missing():
        pytest.skip(_emulator_missing())
    from mhattn.backends.cupy.emulator import EmulatorLauncher

    return CupyBackend(launcher=EmulatorLauncher(), compute_capability=(9, 0))


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(ops, "POISON_OUTPUTS", True)


EMULATED = {
    # GQA, causal bottom-right with Nq < Nk, grad_lse, d padded from 40 to 64, atomic dQ
    "gqa_causal_br": dict(shape=(1, 4, 2, 70, 100, 40), dtype=torch.bfloat16, causal="bottom_right",
                          grad_lse=True, deterministic=False),
    # key padding mask broadcast over heads and queries, dropout, fully masked row, strided views
    "mask_dropout": dict(shape=(2, 2, 1, 66, 66, 32), dtype=torch.float16, keypad=True, dropout_p=0.17,
                         strided=True),
    # the two-dimensional dK/dV kernel in both modes: several key blocks, MQA, causal top-left with Nq > Nk,
    # K and V in registers; then dropout with a key padding mask and a fully masked row, atomic dQ
    "2d_causal_tl": dict(shape=(1, 2, 1, 130, 90, 128), dtype=torch.float16, causal="top_left",
                         dkdv_tiles={128: (64, 64, 4, 2, 2, 2, False)}),
    "2d_regs_window": dict(shape=(1, 2, 2, 100, 140, 64), dtype=torch.bfloat16, window=(20, 7),
                           dkdv_tiles={64: (128, 64, 8, 4, 4, 2, True)}),
    "2d_dropout_atomic": dict(shape=(2, 2, 1, 66, 66, 32), dtype=torch.float16, keypad=True, dropout_p=0.17,
                              deterministic=False, dkdv_tiles={32: (128, 32, 8, 8, 4, 4, False)}),
    # feature variants (SOFTCAP, FLOAT_MASK, ANY_DIMS), each kernel family in both backward modes
    "softcap_causal": dict(shape=(1, 2, 1, 40, 70, 64), dtype=torch.bfloat16, causal="bottom_right", softcap=1.5),
    "softcap_odd_2d_atomic": dict(shape=(1, 2, 2, 50, 60, 111), dtype=torch.float16, softcap=2.0,
                                  deterministic=False, dkdv_tiles={128: (64, 64, 4, 2, 2, 2, False)}),
    "value_dim_atomic": dict(shape=(1, 4, 2, 45, 55, 64), d_v=32, dtype=torch.bfloat16, causal="top_left",
                             deterministic=False),
    "value_dim_2d": dict(shape=(1, 2, 1, 40, 70, 40), d_v=80, dtype=torch.float16,
                         dkdv_tiles={96: (64, 64, 4, 2, 2, 2, False)}),
    "float_mask_grad": dict(shape=(2, 2, 1, 50, 60, 32), dtype=torch.float16, float_mask=True, mask_grad=True),
    "float_mask_2d_atomic": dict(shape=(1, 2, 1, 50, 70, 128), dtype=torch.bfloat16, float_mask=True,
                                 window=(30, 5), deterministic=False, dkdv_tiles={128: (64, 64, 4, 2, 2, 2, False)}),
    "odd_dims_strided_atomic": dict(shape=(1, 2, 1, 45, 45, 59), dtype=torch.float16, strided=True,
                                    causal="top_left", deterministic=False),
    "tiny_dims_gqa": dict(shape=(1, 4, 2, 33, 50, 3), d_v=13, dtype=torch.bfloat16),
    "everything": dict(shape=(1, 2, 1, 40, 50, 20), d_v=36, dtype=torch.bfloat16, softcap=3.0, float_mask=True,
                       mask_grad=True, dropout_p=0.17, causal="bottom_right"),
}


def test_emulated_forward_schedule_groups(emulated_backend, poisoned, monkeypatch):
    # 2 x 3 (batch, head) pairs in scheduling groups of 4 (the last holds 2), three query blocks each: every
    # block of every pair is computed once, in the right place
    assert ops.sched_pairs(6, 100, 64, 2) == 6 and ops.sched_pairs(6, 1 << 20, 256, 2) == 1
    monkeypatch.setattr(ops, "sched_pairs", lambda pairs, *_: min(pairs, 4))
    q, k, v, grad_out = _inputs(2, 3, 3, 300, 77, 32, torch.float16, "cpu")
    params = _params(300, 77, 32, causal="bottom_right")
    out, lse = emulated_backend.forward(q, k, v, params)
    gold_out, gold_lse = naive_attention(q.double(), k.double(), v.double(), params)
    lowp_out, lowp_lse = naive_attention(q, k, v, params)
    for name, x, g, lp in (("out", out, gold_out, lowp_out), ("lse", lse, gold_lse, lowp_lse)):
        result = compare(name, x, g, lp, dtype=torch.float16)
        assert result.ok, str(result)


@pytest.mark.parametrize("name", sorted(EMULATED))
def test_emulated_kernels_match_reference(emulated_backend, poisoned, monkeypatch, name):
    case = EMULATED[name]
    table = variants.DKDV_TILES if case.get("deterministic", True) else variants.DKDV_ATOMIC_TILES
    for bucket, fields in case.get("dkdv_tiles", {}).items():
        monkeypatch.setitem(table, bucket, variants.dkdv_tiles_from_fields(*fields))
    batch, hq, hkv, nq, nk, d = case["shape"]
    q, k, v, grad_out = _inputs(batch, hq, hkv, nq, nk, d, case["dtype"], "cpu", strided=case.get("strided", False),
                                d_v=case.get("d_v"))
    mask = None
    if case.get("keypad"):
        keys = torch.rand(batch, 1, 1, nk, generator=torch.Generator().manual_seed(1)) > 0.3
        mask = keys.expand(batch, hq, nq, nk).clone()
        mask[0, 0, 5] = False  # a row that sees nothing: out 0, lse -inf, gradients 0
    if case.get("float_mask"):
        mask = _float_mask(batch, hq, nq, nk, case["dtype"], "cpu")
    params = _params(nq, nk, d, causal=case.get("causal"), window=case.get("window"), mask=mask,
                     dropout_p=case.get("dropout_p", 0.0), seed=(12345, 678), softcap=case.get("softcap"),
                     mask_requires_grad=case.get("mask_grad", False))
    grad_lse = torch.randn(batch, hq, nq) if case.get("grad_lse") else None
    emulated_backend.deterministic = case.get("deterministic", True)
    failures = _check(emulated_backend, q, k, v, grad_out, params, grad_lse)
    assert not failures, failures


def test_emulated_calls_that_differ_in_one_thing_get_their_own_plans(emulated_backend, poisoned):
    """Call signatures that agree on everything but the strides, the key count or the mask's strides (the mask
    is not compared by AttentionParams), interleaved: a plan used across them would launch with the wrong
    strides, sizes or mask layout, and the results would miss the reference."""
    emulated_backend.deterministic = True
    dtype = torch.float16
    dense = _inputs(1, 2, 2, 66, 66, 32, dtype, "cpu")
    strided = _inputs(1, 2, 2, 66, 66, 32, dtype, "cpu", strided=True, seed=1)
    longer = _inputs(1, 2, 2, 66, 90, 32, dtype, "cpu", seed=2)
    causal = _params(66, 66, 32, causal="top_left")
    assert causal == _params(66, 90, 32, causal="top_left")  # the same parameters for both key counts
    keys = torch.rand(1, 1, 1, 66, generator=torch.Generator().manual_seed(3)) > 0.3
    pairs = torch.rand(1, 1, 66, 66, generator=torch.Generator().manual_seed(4)) > 0.3
    key_padding = causal.replace(mask=keys.expand(1, 2, 66, 66))  # strides (66, 0, 0, 1)
    per_pair = causal.replace(mask=pairs.expand(1, 2, 66, 66))  # strides (4356, 0, 66, 1)
    assert key_padding == per_pair == causal
    for (q, k, v, grad_out), params in ((dense, causal), (strided, causal), (dense, causal), (longer, causal),
                                        (dense, key_padding), (dense, per_pair), (dense, causal)):
        failures = _check(emulated_backend, q, k, v, grad_out, params)
        assert not failures, failures


def test_cupy_launch_values_hold_the_typed_values_bits():
    """The objects CuPy launches with as they are (made once per plan) hold exactly the typed value's bytes."""
    import ctypes

    import numpy as np

    pytest.importorskip("cupy")
    from mhattn.backends.cupy.launcher import cupy_value, numpy_value

    for kind, value in (("i32", -7), ("u32", 0xFFFFFFFE), ("i64", -(1 << 40)), ("f32", -0.0), ("f32", 0.1),
                        ("ptr", (1 << 47) + 16)):
        made, expected = cupy_value(kind, value), numpy_value(kind, value)
        if isinstance(made, np.generic):
            assert made == expected  # a CuPy without a value object we can make: numpy scalars, as before
        elif hasattr(made, "ptr"):  # CuPy 14: CScalar, its value's address readable
            assert ctypes.string_at(made.ptr, expected.itemsize) == expected.tobytes(), (kind, value)


# ---- CPU: per-signature plans and the CuPy launcher's hot path -----------------------------------------------


class _RecordingLauncher:
    """Prepares launches that record each call's arguments instead of running anything."""

    def __init__(self):
        self.prepared = []  # (variant, grid) of each prepare
        self.calls = []  # (variant, grid, (kind, value) arguments) of each launch

    def prepare(self, variant, grid, template, device, cc):
        self.prepared.append((variant, grid))
        return lambda pointers: self.calls.append((variant, grid, template.bind(pointers)))


def test_calls_autograd_does_not_track_write_their_lse_into_one_kept_scratch(monkeypatch):
    """native_call gives the forward's output alone for calls without a gradient and nothing for calls autograd
    tracks; its launches write the lse into the plan's scratch view (the same at every call), where the backend's
    forward gives each call an lse of its own."""
    from mhattn.backends import layouts

    monkeypatch.setattr(layouts, "_scratch_buffers", {})
    launcher = _RecordingLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(8, 0))
    q, k, v, _ = _inputs(2, 4, 2, 50, 70, 64, torch.bfloat16, "cpu")
    params = _params(50, 70, 64, causal="bottom_right")
    output_only = backend.native_call(q, k, v, params)
    assert output_only is not None
    assert backend.native_call(q.clone().requires_grad_(), k, v, params) is None
    written = []
    for _ in range(3):
        out = output_only(q, k, v, params)
        assert out.shape == (2, 4, 50, 64)
        written.append(launcher.calls[-1][2][4])  # the forward kernel's lse pointer
    scratch = layouts._scratch_buffers[("cpu", None)][-1]
    assert written == [("ptr", scratch.data_ptr())] * 3
    kept = [backend.forward(q, k, v, params)[1] for _ in range(2)]
    assert [launcher.calls[i][2][4] for i in (-2, -1)] == [("ptr", lse.data_ptr()) for lse in kept]
    assert all(lse.data_ptr() != scratch.data_ptr() and lse.shape == (2, 4, 50) for lse in kept)


def test_a_repeated_call_chooses_no_variant_and_prepares_no_launch(monkeypatch):
    launcher = _RecordingLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0), deterministic=True)
    q, k, v, grad_out = _inputs(1, 4, 2, 50, 70, 64, torch.bfloat16, "cpu")
    params = _params(50, 70, 64, causal="bottom_right", softcap=3.0)
    out, lse = backend.forward(q, k, v, params)
    backend.backward(grad_out, q, k, v, out, lse, params)
    prepared, first = len(launcher.prepared), launcher.calls[:]
    spied = []
    for module, name in ((ops, "_fwd_choice"), (ops, "_bwd_choice"), (ops, "feature_flags"), (ops, "kernel_ready"),
                         (variants, "fwd_variant"), (variants, "dkdv_variants"), (variants, "dq_variant")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: spied.append(_n) or _f(*a, **kw))
    launcher.calls.clear()
    q2, k2, v2, grad_out2 = (t.clone() for t in (q, k, v, grad_out))  # other addresses, the same signature
    out2, lse2 = backend.forward(q2, k2, v2, params.replace())  # an equal AttentionParams, another object
    dq2, dk2, dv2, _ = backend.backward(grad_out2, q2, k2, v2, out2, lse2, params.replace())
    assert spied == [] and len(launcher.prepared) == prepared
    assert [c[:2] for c in launcher.calls] == [c[:2] for c in first]
    for (_, _, again), (_, _, before) in zip(launcher.calls, first):  # only the pointers differ
        assert [a for a in again if a[0] != "ptr"] == [b for b in before if b[0] != "ptr"]
    fwd_args, dq_args = launcher.calls[0][2], launcher.calls[-1][2]
    assert fwd_args[:5] == [("ptr", t.data_ptr()) for t in (q2, k2, v2, out2, lse2)]
    assert dq_args[:4] == [("ptr", t.data_ptr()) for t in (q2, k2, v2, grad_out2)]
    assert dq_args[6] == ("ptr", dq2.data_ptr())


def test_a_changed_tile_table_entry_makes_the_plan_again(monkeypatch):
    launcher = _RecordingLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0))
    q, k, v, _ = _inputs(1, 2, 2, 40, 40, 64, torch.bfloat16, "cpu")
    params = _params(40, 40, 64)
    backend.forward(q, k, v, params)
    backend.forward(q, k, v, params)
    prepared = len(launcher.prepared)
    monkeypatch.setitem(variants.FWD_TILES, 64, variants.FwdTiles(64, 32, 4, True))
    backend.forward(q, k, v, params)
    assert len(launcher.prepared) == prepared + 1 and launcher.prepared[-1][0].define("BLOCK_M") == 64
    assert launcher.calls[-1][1] == (1, 2, 1)  # the grid of 64-row query blocks


def test_plans_hold_none_of_the_callers_tensors():
    import gc
    import weakref

    backend = CupyBackend(launcher=_RecordingLauncher(), compute_capability=(9, 0))
    q, k, v, grad_out = _inputs(1, 2, 2, 40, 40, 64, torch.bfloat16, "cpu")
    mask = torch.rand(1, 1, 40, 40) > 0.5
    seed = torch.tensor([1, 2])
    params = _params(40, 40, 64, mask=mask.expand(1, 2, 40, 40), dropout_p=0.1, seed=seed)
    out, lse = backend.forward(q, k, v, params)
    backend.backward(grad_out, q, k, v, out, lse, params)
    refs = [weakref.ref(t) for t in (q, k, v, grad_out, out, lse, mask, seed)]
    del q, k, v, grad_out, out, lse, mask, seed, params
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_a_devices_shared_memory_limit_replaces_the_table(monkeypatch):
    monkeypatch.setattr(variants, "_DEVICE_SMEM_LIMIT", {})
    assert variants.smem_limit((8, 6)) == 99 * 1024  # not in the table: the smallest
    big = variants.fwd_tiles((8, 6), 128)
    variants.note_device_smem_limit((8, 6), 64 * 1024)
    assert variants.smem_limit((8, 6)) == 64 * 1024 and variants.smem_limit((9, 0)) == 227 * 1024
    small = variants.fwd_tiles((8, 6), 128)
    assert variants.fwd_smem(small, 128) <= 64 * 1024 < variants.fwd_smem(big, 128)


@pytest.mark.parametrize("field", [8, None], ids=["address word", "encoded in full"])
def test_row_maps_keep_the_argument_made_for_each_address(monkeypatch, field):
    """RowMaps gives, for an address it saw lately, the argument it made then (the same object), with the content an
    encoding at that address has; past ADDRESSES_KEPT addresses the oldest is made again. A fake encoder stands in
    for the driver's (the map's bytes: a pattern of the layout, the address in one 64-bit word)."""
    import numpy as np

    from mhattn.backends.cupy import tensor_maps

    encoded = []

    class FakeEncoder:
        def __init__(self, shape, strides, element_size, dtype, box_rows):
            self.pattern = bytes((sum(shape) + box_rows + i) % 251 for i in range(tensor_maps.MAP_BYTES))

        def encode_into(self, buffer, address):
            encoded.append(address)
            raw = bytearray(self.pattern)
            raw[8:16] = address.to_bytes(8, "little")
            buffer.raw = bytes(raw)

    monkeypatch.setattr(tensor_maps, "_Encoder", FakeEncoder)
    monkeypatch.setattr(tensor_maps, "address_field", lambda: field)
    t = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    maps = tensor_maps.RowMaps(t, 64)
    want = FakeEncoder(tuple(t.shape), t.stride(), 2, t.dtype, 64)

    def content(value, address):
        raw = bytearray(want.pattern)
        raw[8:16] = address.to_bytes(8, "little")
        return np.asarray(value).tobytes() == bytes(raw)

    a, b = 0x7F0000001000, 0x7F0000002000
    first = maps(a)
    assert content(first, a) and maps(a) is first
    assert content(maps(b), b) and maps(b) is not first
    made_before = len(encoded)
    for i in range(tensor_maps.ADDRESSES_KEPT):  # pushes a out
        maps(0x7F1000000000 + 256 * i)
    again = maps(a)
    assert again is not first and content(again, a)
    if field is None:  # every argument made is an encoding; none for those found
        assert len(encoded) == made_before + tensor_maps.ADDRESSES_KEPT + 1


class _MapLauncher(_RecordingLauncher):
    """A recording launcher that takes tensor maps (as CupyLauncher does)."""

    tensor_maps = True


@pytest.fixture
def recorded_maps(monkeypatch):
    """tensor_maps.RowMaps replaced (no CUDA driver here): records (shape, strides, box rows) of each map made; a
    map at an address is the int 10**15 + box rows * 10**12 + address (so a recording launcher can bind it). The
    GPU has 5 SMs."""
    made = []
    monkeypatch.setattr(ops, "sm_count", lambda device: 5)

    class RecordedMaps:
        def __init__(self, t, box_rows, wrap=None):
            made.append((tuple(t.shape), t.stride(), box_rows))
            self.rows = box_rows

        def __call__(self, address):
            return 10**15 + self.rows * 10**12 + address

    monkeypatch.setattr(ops.tensor_maps, "RowMaps", RecordedMaps)
    return made


# The Hopper kernels' last arguments for a call with no attn_mask and no softcap: the boolean mask and its four
# strides, the two softcap factors, the float mask and its four strides, all zero.
HOPPER_NO_MASK_OR_SOFTCAP_ARGS = [("ptr", 0)] + [("i64", 0)] * 4 + [("f32", 0.0)] * 2 + [("ptr", 0)] + [("i64", 0)] * 4


@pytest.mark.parametrize("causal", [None, "top_left"])
def test_hopper_forward_groups_pairs_by_the_tiles_cost(recorded_maps, monkeypatch, causal):
    """The forward's sched_pairs argument: tiles of equal cost (no causal mask or window) run in groups of the pairs
    whose K and V fit ops.SCHED_L2_BYTES_EQUAL_TILES, tiles taken from a counter (causal) in groups of SCHED_L2_BYTES'."""
    tiles = dataclasses.replace(variants.HOPPER_FWD_TILES[128], staged_out=False)
    monkeypatch.setitem(variants.HOPPER_FWD_TILES, 128, tiles)
    launcher = _MapLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0))
    q, k, v, _ = _inputs(2, 4, 2, 300, 517, 128, torch.bfloat16, "cpu")
    backend.forward(q, k, v, _params(300, 517, 128, causal=causal))
    args = launcher.calls[-1][2]
    group = ops.sched_pairs(8, 517, 128, 2, ops.SCHED_L2_BYTES if causal else ops.SCHED_L2_BYTES_EQUAL_TILES)
    # K and V of a pair: 2 * 517 * 128 * 2 bytes, three of them in 1 MB; all 8 pairs in 16 MB
    assert group == (8 if causal else 3)
    assert args[9:15] == [("i32", 300), ("i32", 517), ("i32", 4), ("i32", 2), ("i32", 8), ("i32", group)]


def test_hopper_forward_plan_launches_the_hopper_kernel_with_maps(recorded_maps, monkeypatch):
    """The forward with the output stored by the consumers (three maps; the staged output's fourth: the test
    below)."""
    tiles = dataclasses.replace(variants.HOPPER_FWD_TILES[128], staged_out=False)
    monkeypatch.setitem(variants.HOPPER_FWD_TILES, 128, tiles)
    launcher = _MapLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0))
    q, k, v, _ = _inputs(2, 4, 2, 300, 517, 128, torch.bfloat16, "cpu")
    params = _params(300, 517, 128, causal="bottom_right", window=(64, None))
    out, lse = backend.forward(q, k, v, params)
    variant, grid, args = launcher.calls[-1]
    block_m = 64 * tiles.consumers
    # under a causal mask or window the variant takes turns as HopperFwdTiles.masked_pingpong says
    assert variant == variants.hopper_fwd_variant("bfloat16", 128, masked=True) and variant.arch_features == "a"
    assert variant.define("PINGPONG") == int(tiles.pingpong_for(True))
    tile_count = -(-300 // block_m) * 8
    assert grid == ((min(tile_count, 5) if tiles.persistent else tile_count), 1, 1)
    assert recorded_maps == [(tuple(q.shape), q.stride(), block_m), (tuple(k.shape), k.stride(), tiles.block_n),
                             (tuple(v.shape), v.stride(), tiles.block_n)]
    maps = [10**15 + rows * 10**12 + t.data_ptr() for rows, t in ((block_m, q), (tiles.block_n, k), (tiles.block_n, v))]
    assert args[:5] == [("ptr", p) for p in maps + [out.data_ptr(), lse.data_ptr()]]
    assert (args[5][0] == "ptr" and args[5][1] != 0) == tiles.persistent  # a tile counter: causal, persistent
    assert args[6:] == [("i64", s) for s in out.stride()[:3]] + [
        ("i32", 300), ("i32", 517), ("i32", 4), ("i32", 2), ("i32", 8), ("i32", ops.sched_pairs(8, 517, 128, 2)),
        ("f32", params.scale * ops.LOG2E), ("i32", 217), ("i32", 64), ("i32", 0)] + HOPPER_NO_MASK_OR_SOFTCAP_ARGS
    # a second call with other tensors of the same signature makes no map and prepares nothing
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    backend.forward(q2, k2, v2, params)
    assert len(recorded_maps) == 3 and len(launcher.prepared) == 1
    assert launcher.calls[-1][2][0] == ("ptr", 10**15 + block_m * 10**12 + q2.data_ptr())
    # without a mask the tiles cost the same: persistent without a counter (the tiles gridDim.x apart)
    backend.forward(q, k, v, _params(300, 517, 128))
    assert launcher.calls[-1][1] == ((5, 1, 1) if tiles.persistent else (tile_count, 1, 1))
    assert launcher.calls[-1][2][5] == ("ptr", 0)
    assert launcher.calls[-1][0] == variants.hopper_fwd_variant("bfloat16", 128)
    assert launcher.calls[-1][0].define("PINGPONG") == int(tiles.pingpong)


def test_hopper_forward_takes_turns_per_mask_as_the_tiles_say():
    """HopperFwdTiles.masked_pingpong: the shipped tiles take turns without a mask and run freely under a causal mask
    or window at d = 128 and 256 (the H10 sweeps, NOTES H12), run freely either way at d = 64; None keeps
    ``pingpong`` for both; the family lists each distinct variant once."""
    tiles = variants.HOPPER_FWD_TILES
    assert [(tiles[d].pingpong_for(False), tiles[d].pingpong_for(True)) for d in (64, 128, 256)] == [
        (False, False), (True, False), (True, False)]
    same = dataclasses.replace(tiles[128], masked_pingpong=None)
    assert same.pingpong_for(True) is True and variants.hopper_fwd_variant(
        "float16", 128, same, masked=True) == variants.hopper_fwd_variant("float16", 128, same)
    forward = [v for v in variants.hopper_variants() if v.kernel == "hopper_fwd"]
    # per dtype, with or without a softcap, no / a boolean / a float mask: d = 64 once, d = 128 and 256 twice
    assert len(forward) == len(set(forward)) == 2 * 2 * 3 * 5
    assert {(v.define("HEAD_DIM"), v.define("PINGPONG")) for v in forward} == {(64, 0), (128, 1), (128, 0), (256, 1),
                                                                             (256, 0)}


@pytest.mark.parametrize("field, define", [("lazy_rescale", "LAZY_RESCALE"),
                                           ("turns_across_tiles", "TURNS_ACROSS_TILES")])
def test_hopper_forward_switches_follow_the_tiles(recorded_maps, monkeypatch, field, define):
    """HopperFwdTiles.lazy_rescale / turns_across_tiles: LAZY_RESCALE / TURNS_ACROSS_TILES in the launched variant,
    with or without a causal mask, and nothing else of the variant changed (its shared memory, its turns)."""
    for d in (64, 128, 256):
        tiles = variants.HOPPER_FWD_TILES[d]
        for on in (False, True):
            monkeypatch.setitem(variants.HOPPER_FWD_TILES, d, dataclasses.replace(tiles, **{field: on}))
            launcher = _MapLauncher()
            backend = CupyBackend(launcher=launcher, compute_capability=(9, 0))
            q, k, v, _ = _inputs(1, 2, 2, 200, 200, d, torch.float16, "cpu")
            for causal in (None, "top_left"):
                backend.forward(q, k, v, _params(200, 200, d, causal=causal))
                variant = launcher.calls[-1][0]
                assert variant.kernel == "hopper_fwd" and variant.define(define) == int(on)
                other = dict(variants.hopper_fwd_variant("float16", d, tiles, masked=causal is not None).defines)
                assert {k: v for k, v in variant.defines if k != define} == {
                    k: v for k, v in other.items() if k != define}


def test_hopper_forward_with_the_output_staged_passes_the_output_s_map(recorded_maps, monkeypatch):
    """HopperFwdTiles.staged_out: the variant has STAGED_OUT=1 and the shared memory of a second Q buffer, and the
    launch passes a fourth map, of the output in boxes of 64 rows, right after v's (the kernel's parameter order);
    at d = 256 there is no room for it (a clear error)."""
    tiles = dataclasses.replace(variants.HOPPER_FWD_TILES[128], staged_out=True)
    monkeypatch.setitem(variants.HOPPER_FWD_TILES, 128, tiles)
    launcher = _MapLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0))
    q, k, v, _ = _inputs(1, 2, 2, 300, 300, 128, torch.bfloat16, "cpu")
    out, lse = backend.forward(q, k, v, _params(300, 300, 128))
    variant, grid, args = launcher.calls[-1]
    assert variant.define("STAGED_OUT") == 1
    plain = dataclasses.replace(tiles, staged_out=False)
    assert variant.define("SMEM_BYTES") == variants.hopper_fwd_smem(plain, 128) + 64 * tiles.consumers * 128 * 2 + 16
    assert recorded_maps[3] == (tuple(out.shape), out.stride(), 64)
    block_m = 64 * tiles.consumers
    maps = [10**15 + rows * 10**12 + t.data_ptr()
            for rows, t in ((block_m, q), (tiles.block_n, k), (tiles.block_n, v), (64, out))]
    assert args[:6] == [("ptr", p) for p in maps + [out.data_ptr(), lse.data_ptr()]]
    assert args[7:10] == [("i64", s) for s in out.stride()[:3]]
    with pytest.raises(ValueError, match="shared memory"):
        variants.hopper_fwd_variant("bfloat16", 256, dataclasses.replace(variants.HOPPER_FWD_TILES[256], staged_out=True))


@pytest.mark.parametrize("case", ["head dim 96", "value head dim", "dropout",
                                  "sm_80", "broadcast keys", "unaligned rows", "no maps", "switched off"])
def test_hopper_forward_refusals_take_the_mma_sync_forward(recorded_maps, monkeypatch, case):
    d = 96 if case == "head dim 96" else 64
    q, k, v, _ = _inputs(1, 2, 2, 40, 40, d, torch.float16, "cpu", d_v=32 if case == "value head dim" else None)
    kwargs = {"dropout": {"dropout_p": 0.1, "seed": torch.tensor([1, 2])}}.get(case, {})
    if case == "broadcast keys":
        k = k[:, :1].expand(1, 2, 40, d)
    if case == "unaligned rows":
        q = torch.randn(1, 2, 40 * d + 4, dtype=torch.float16)[..., 4:].view(1, 2, 40, d)  # start 8 bytes off
    if case == "switched off":
        monkeypatch.setattr(ops, "HOPPER_ENABLED", False)
    launcher = _RecordingLauncher() if case == "no maps" else _MapLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(8, 0) if case == "sm_80" else (9, 0))
    backend.forward(q, k, v, _params(40, 40, d, **kwargs))
    assert launcher.calls[-1][0].kernel == "fwd" and recorded_maps == []


def test_hopper_kernels_take_a_softcap_through_a_variant_and_two_factors(recorded_maps):
    """A softcap runs the Hopper forward and backward compiled with SOFTCAP=1, each given common.cuh's two factors
    (2 log2(e) scale / softcap, softcap log2(e)) as its last arguments; without one they get zeros."""
    launcher = _MapLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0), deterministic=False)
    q, k, v, grad_out = _inputs(1, 2, 2, 200, 200, 128, torch.float16, "cpu")
    params = _params(200, 200, 128, causal="top_left", softcap=30.0)
    factors = [("f32", 2.0 * ops.LOG2E * params.scale / 30.0), ("f32", 30.0 * ops.LOG2E)]
    out, lse = backend.forward(q, k, v, params)
    variant, _, args = launcher.calls[-1]
    assert variant == variants.hopper_fwd_variant("float16", 128, masked=True, softcap=True)
    assert variant.define("SOFTCAP") == 1 and args[-7:-5] == factors
    backend.backward(grad_out, q, k, v, out, lse, params)
    variant, _, args = launcher.calls[-1]
    assert variant == variants.hopper_bwd_variant("float16", 128, softcap=True) and args[-7:-5] == factors
    backend.deterministic = True
    backend.backward(grad_out, q, k, v, out, lse, params)
    assert launcher.calls[-1][0] == variants.hopper_bwd_variant("float16", 128, deterministic=True, softcap=True)
    assert {v for v in variants.hopper_variants() if v.define("SOFTCAP")} >= {
        launcher.calls[-1][0], variants.hopper_fwd_variant("float16", 128, masked=True, softcap=True)}


def test_hopper_kernels_take_a_boolean_mask_by_pointer_and_strides(recorded_maps):
    """A boolean attn_mask runs the Hopper forward and backward compiled with BOOL_MASK=1: the mask's address (the
    forward's eighth pointer, the backward's mask slot) and its four strides (0 where broadcast) follow the window
    bounds."""
    launcher = _MapLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0), deterministic=False)
    q, k, v, grad_out = _inputs(2, 4, 2, 200, 300, 64, torch.bfloat16, "cpu")
    mask = (torch.rand(2, 1, 1, 300) > 0.3).expand(2, 4, 200, 300)  # key padding, broadcast over heads and queries
    params = _params(200, 300, 64, mask=mask)
    strides = [("i64", s) for s in mask.stride()]
    out, lse = backend.forward(q, k, v, params)
    variant, _, args = launcher.calls[-1]
    assert variant == variants.hopper_fwd_variant("bfloat16", 64, bool_mask=True) and variant.define("BOOL_MASK") == 1
    assert args[-12:-5] == [("ptr", mask.data_ptr())] + strides + [("f32", 0.0), ("f32", 0.0)]
    assert strides[1:3] == [("i64", 0), ("i64", 0)]
    backend.backward(grad_out, q, k, v, out, lse, params)
    variant, _, args = launcher.calls[-1]
    assert variant == variants.hopper_bwd_variant("bfloat16", 64, bool_mask=True)
    assert args[-12:-5] == [("ptr", mask.data_ptr())] + strides + [("f32", 0.0), ("f32", 0.0)]
    # per dtype: forward 5 tile forms x 2 softcaps x 3 masks; backward 5 feature sets (no float mask with a softcap)
    # at d = 64 and 128, reproducible at d = 128, and with dQ stored directly (one key block) at d = 64 and 128
    assert len(variants.hopper_variants()) == len(set(variants.hopper_variants())) == 2 * (30 + 5 * 3 + 5 * 2)


def test_hopper_kernels_take_a_float_mask_as_float32_by_pointer_and_strides(recorded_maps):
    """A float attn_mask runs the Hopper forward and backward compiled with FLOAT_MASK=1: its float32 view
    (ops.float_mask_view: broadcast dims stay stride 0) by address (the forward's ninth pointer, the backward's
    float_mask slot) and four strides, the kernels' last arguments. Its gradient, or a softcap with it in the
    backward, keeps the mma.sync kernels; both say why."""
    launcher = _MapLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0), deterministic=False)
    q, k, v, grad_out = _inputs(2, 4, 2, 200, 300, 128, torch.bfloat16, "cpu")
    bias = torch.randn(2, 1, 1, 300, dtype=torch.bfloat16).expand(2, 4, 200, 300)  # HF-style padding bias
    params = _params(200, 300, 128, mask=bias)
    view = ops.float_mask_view(bias)
    strides = [("i64", 0 if view.shape[i] == 1 else view.stride(i)) for i in range(4)]
    out, lse = backend.forward(q, k, v, params)
    variant, _, args = launcher.calls[-1]
    assert variant == variants.hopper_fwd_variant("bfloat16", 128, float_mask=True)
    assert args[-5][0] == "ptr" and args[-5][1] != 0 and args[-4:] == strides and strides[1:3] == [("i64", 0)] * 2
    backend.backward(grad_out, q, k, v, out, lse, params)
    variant, _, args = launcher.calls[-1]
    assert variant == variants.hopper_bwd_variant("bfloat16", 128, float_mask=True) and args[-4:] == strides
    backend.backward(grad_out, q, k, v, out, lse, _params(200, 300, 128, mask=bias, softcap=20.0))
    assert launcher.calls[-1][0].kernel != "hopper_bwd"
    backend.backward(grad_out, q, k, v, out, lse, _params(200, 300, 128, mask=bias, mask_requires_grad=True))
    assert launcher.calls[-1][0].kernel == "bwd_dq"
    problem = _problem(features=frozenset({"float_mask", "softcap"}))
    assert "hopper_fwd.cu" in backend.forward_path(problem)
    assert "a float mask with a softcap" in backend.backward_path(problem)
    assert "a float mask's gradient" in backend.backward_path(_problem(features=frozenset({"float_mask",
                                                                                          "mask_grad"})))
    with pytest.raises(ValueError, match="softcap or a float mask"):
        variants.hopper_bwd_variant("bfloat16", 128, softcap=True, float_mask=True)
    # a mask that varies along the queries: the mma.sync forward (as fast there), the Hopper backward
    full = _float_mask(2, 4, 200, 300, torch.bfloat16, "cpu")
    out, lse = backend.forward(q, k, v, _params(200, 300, 128, mask=full))
    assert launcher.calls[-1][0].kernel == "fwd"
    backend.backward(grad_out, q, k, v, out, lse, _params(200, 300, 128, mask=full))
    assert launcher.calls[-1][0] == variants.hopper_bwd_variant("bfloat16", 128, float_mask=True)
    assert "a float mask broadcast over the queries" in backend.forward_path(_problem(features=frozenset({
        "float_mask"})))


def test_forward_path_names_the_family():
    backend = CupyBackend(compute_capability=(9, 0))
    assert "hopper_fwd.cu" in backend.forward_path(_problem())
    assert backend.forward_path(_problem(compute_capability=(8, 0))).startswith(
        "the mma.sync forward (kernels/fwd.cu): not the Hopper forward because not an sm_90 GPU")
    assert "dropout" in backend.forward_path(_problem(features=frozenset({"dropout"})))
    assert "hopper_fwd.cu" in backend.forward_path(_problem(features=frozenset({"bool_mask"})))
    assert "hopper_fwd.cu" in backend.forward_path(_problem(features=frozenset({"softcap"})))
    assert "hopper_bwd.cu" in backend.backward_path(_problem(features=frozenset({"softcap"})))
    assert "head dims 96/96" in backend.forward_path(_problem(head_dim=96, head_dim_v=96))
    assert "hopper_bwd.cu" in backend.backward_path(_problem())
    reproducible = CupyBackend(compute_capability=(9, 0), deterministic=True)
    assert "hopper_bwd.cu" in reproducible.backward_path(_problem(head_dim=128, head_dim_v=128))
    assert "in turns: deterministic" in reproducible.backward_path(_problem(head_dim=128, head_dim_v=128))
    assert "dQ stored directly, every key in one CTA" in backend.backward_path(_problem(seqlen_k=128))
    assert "dQ stored directly" not in backend.backward_path(_problem(seqlen_k=129))
    assert "not the Hopper backward because a deterministic backward at head dim 64" in reproducible.backward_path(
        _problem(head_dim=64, head_dim_v=64))
    assert backend.backward_path(_problem(head_dim=256, head_dim_v=256)).startswith(
        "the mma.sync backward (kernels/bwd_*.cu): not the Hopper backward because head dims 256/256")


def test_hopper_backward_plan_launches_the_preprocess_then_the_hopper_kernel(recorded_maps):
    launcher = _MapLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0), deterministic=False)
    q, k, v, grad_out = _inputs(2, 4, 2, 300, 517, 128, torch.bfloat16, "cpu")
    params = _params(300, 517, 128, causal="bottom_right")
    out, lse = backend.forward(q, k, v, params)  # recorded, not run: the backward reads nothing here
    del recorded_maps[:]
    dq, dk, dv, _ = backend.backward(grad_out, q, k, v, out, lse, params)
    assert [call[0].kernel for call in launcher.calls[-2:]] == ["bwd_preprocess", "hopper_bwd"]
    variant, grid, args = launcher.calls[-1]
    assert variant == variants.hopper_bwd_variant("bfloat16", 128) and grid == (-(-517 // 128), 2, 2)
    assert recorded_maps == [(tuple(t.shape), t.stride(), rows) for t, rows in ((q, 64), (k, 128), (v, 128),
                                                                                (grad_out, 64))]
    maps = [10**15 + rows * 10**12 + t.data_ptr() for t, rows in ((q, 64), (k, 128), (v, 128), (grad_out, 64))]
    assert args[:4] == [("ptr", p) for p in maps] and args[8:10] == [("ptr", dk.data_ptr()), ("ptr", dv.data_ptr())]
    assert args[10:16] == [("i64", s) for s in dk.stride()[:3] + dv.stride()[:3]]
    shape_and_features = [("i32", 300), ("i32", 384), ("i32", 517), ("i32", 4), ("i32", 2),
                          ("f32", params.scale * ops.LOG2E), ("f32", params.scale), ("i32", 217),
                          ("i32", ops.UNBOUNDED), ("i32", 0)] + HOPPER_NO_MASK_OR_SOFTCAP_ARGS
    assert args[16:] == shape_and_features
    assert args[6][1] != 0 and args[7] == ("ptr", 0)  # the float32 dQ accumulator; no turn counters
    # reproducible gradients asked for: the same kernel with DETERMINISTIC=1 and, right after the accumulator in the
    # same zeroed buffer, a turn counter per (batch, query head, query block of 64)
    backend.deterministic = True
    backend.backward(grad_out, q, k, v, out, lse, params)
    variant, grid, args = launcher.calls[-1]
    assert variant == variants.hopper_bwd_variant("bfloat16", 128, deterministic=True)
    assert variant.define("DETERMINISTIC") == 1 and grid == (-(-517 // 128), 2, 2)
    assert args[7][1] == args[6][1] + 4 * 2 * 4 * 300 * 128
    assert args[16:] == shape_and_features
    # at d = 64 reproducible gradients keep the mma.sync dQ kernel (faster there: HOPPER_BWD_DETERMINISTIC_DIMS)
    q, k, v, grad_out = _inputs(1, 2, 2, 200, 200, 64, torch.bfloat16, "cpu")
    params = _params(200, 200, 64)
    out, lse = backend.forward(q, k, v, params)
    backend.backward(grad_out, q, k, v, out, lse, params)
    assert launcher.calls[-1][0].kernel == "bwd_dq"


@pytest.mark.parametrize("deterministic", [False, True])
def test_hopper_backward_of_one_key_block_stores_dq_itself(recorded_maps, monkeypatch, deterministic):
    """Where every key fits one CTA (at most 128) and dQ is (B, Hq, Nq, D) contiguous, the Hopper backward is the
    DQ_DIRECT variant (the writers' own stores, no turns: reproducible as it is, so also when asked for) handed dQ
    itself in the accumulator's place: no zeroed float32 buffer is allocated and nothing is copied after the launch.
    129 keys, or dQ laid out like strided q (a packed projection's views), take the accumulator again. (Reproducible
    gradients at d = 64 keep the mma.sync kernels, as for any key count: HOPPER_BWD_DETERMINISTIC_DIMS.)"""
    launcher = _MapLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0), deterministic=deterministic)
    zeros, copies = [], []
    real_zeros, real_copy = torch.zeros, torch.Tensor.copy_
    monkeypatch.setattr(ops.torch, "zeros", lambda *a, **kw: zeros.append(a) or real_zeros(*a, **kw))
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *a, **kw: copies.append(1) or real_copy(self, *a, **kw))
    for d in (128,) if deterministic else (64, 128):
        q, k, v, grad_out = _inputs(2, 4, 2, 300, 128, d, torch.bfloat16, "cpu")
        params = _params(300, 128, d, causal="bottom_right")
        out, lse = backend.forward(q, k, v, params)
        del zeros[:], copies[:]
        dq, dk, dv, _ = backend.backward(grad_out, q, k, v, out, lse, params)
        variant, grid, args = launcher.calls[-1]
        assert variant == variants.hopper_bwd_variant("bfloat16", d, direct_dq=True) and grid == (1, 2, 2)
        assert variant.define("DQ_DIRECT") == 1 and variant.define("DQ_BULK") == 0
        assert variant.define("DETERMINISTIC") == 0
        assert args[6] == ("ptr", dq.data_ptr()) and args[7] == ("ptr", 0) and not zeros and not copies
    for keys, strided in ((129, False), (100, True)):
        q, k, v, grad_out = _inputs(2, 4, 4, 100, keys, 128, torch.bfloat16, "cpu", strided=strided)
        params = _params(100, keys, 128)
        out, lse = backend.forward(q, k, v, params)
        del zeros[:], copies[:]
        dq, _, _, _ = backend.backward(grad_out, q, k, v, out, lse, params)
        variant, _, args = launcher.calls[-1]
        assert variant == variants.hopper_bwd_variant("bfloat16", 128, deterministic=deterministic)
        assert args[6][1] not in (0, dq.data_ptr()) and zeros and copies


def test_hopper_backward_tiles_from_the_table_and_the_override(recorded_maps, monkeypatch):
    """The Hopper backward's variant follows variants.HOPPER_BWD_TILES (ring slots, dQ by bulk reduce-add), a changed
    entry makes the call's plan again, and MHATTN_CUPY_TILES' "hopper_bwd" table sets it (bad text is named)."""
    monkeypatch.setitem(variants.HOPPER_BWD_TILES, 64, variants.HOPPER_BWD_TILES[64])
    launcher = _MapLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0), deterministic=False)
    q, k, v, grad_out = _inputs(1, 2, 2, 256, 256, 64, torch.bfloat16, "cpu")
    params = _params(256, 256, 64)
    out, lse = backend.forward(q, k, v, params)
    for tiles in (variants.HopperBwdTiles(3, False), variants.HopperBwdTiles(2, True)):
        variants._apply_tile_override(json.dumps({"hopper_bwd": {"64": [tiles.stages, tiles.dq_bulk]}}))
        assert variants.HOPPER_BWD_TILES[64] == tiles
        backend.backward(grad_out, q, k, v, out, lse, params)
        defines = dict(launcher.calls[-1][0].defines)
        assert launcher.calls[-1][0].kernel == "hopper_bwd"
        assert (defines["STAGES"], defines["DQ_BULK"]) == (tiles.stages, int(tiles.dq_bulk))
    with pytest.raises(ValueError, match=variants.TILES_ENV):
        variants._apply_tile_override('{"hopper_bwd": {"64": [2]}}')


def test_hopper_backward_with_two_dq_buffers_has_their_memory_and_barriers(monkeypatch):
    """HopperBwdTiles.dq_buffers: DQ_BUFFERS=2 and the shared memory of a second set of dQ tiles and its two
    barriers; at d = 128 there is no room for it (a clear error)."""
    one = variants.hopper_bwd_variant("bfloat16", 64, variants.HopperBwdTiles(3, False, 1))
    two = variants.hopper_bwd_variant("bfloat16", 64, variants.HopperBwdTiles(3, False, 2))
    assert (one.define("DQ_BUFFERS"), two.define("DQ_BUFFERS")) == (1, 2)
    assert two.define("SMEM_BYTES") - one.define("SMEM_BYTES") == 2 * 64 * (64 + 8) * 4 + 2 * 8
    monkeypatch.setitem(variants.HOPPER_BWD_TILES, 64, variants.HOPPER_BWD_TILES[64])  # put back afterwards
    variants._apply_tile_override('{"hopper_bwd": {"64": [3, true, 2]}}')
    assert variants.HOPPER_BWD_TILES[64] == variants.HopperBwdTiles(3, True, 2)
    with pytest.raises(ValueError, match="shared memory"):
        variants.hopper_bwd_variant("bfloat16", 128, variants.HopperBwdTiles(2, True, 2))


def test_hopper_backward_query_rows_set_the_step_its_maps_and_its_memory(recorded_maps, monkeypatch):
    """HopperBwdTiles.query_rows: QUERY_ROWS in the variant, Q and dO maps with that many box rows (K and V keep 128),
    the shared memory of the taller Q / dO slots, dS^T buffers and dQ tile (one tile: the warpgroups split its rows);
    128 rows only at d = 64 (a clear error elsewhere)."""
    def smem(rows, stages, dq_tiles):  # kernels/hopper_bwd.cu's layout at d = 64
        return (1024 + (2 * 128 + 2 * stages * rows) * 64 * 2 + 2 * 128 * rows * 2 + 2 * stages * rows * 4
                + dq_tiles * rows * (64 + 8) * 4 + 8 * (1 + 2 + 2 * stages))

    tall = variants.HopperBwdTiles(2, False, 1, 128)
    assert variants.hopper_bwd_variant("bfloat16", 64, tall).define("SMEM_BYTES") == smem(128, 2, 1)
    assert variants.hopper_bwd_variant("bfloat16", 64, variants.HopperBwdTiles(2, False)).define(
        "SMEM_BYTES") == smem(64, 2, 2)
    with pytest.raises(ValueError, match="query_rows"):
        variants.hopper_bwd_variant("bfloat16", 128, variants.HopperBwdTiles(2, True, 1, 128))
    with pytest.raises(ValueError, match="shared memory"):  # three ring slots of 128 rows do not fit
        variants.hopper_bwd_variant("bfloat16", 64, variants.HopperBwdTiles(3, False, 1, 128))

    monkeypatch.setitem(variants.HOPPER_BWD_TILES, 64, tall)
    launcher = _MapLauncher()
    backend = CupyBackend(launcher=launcher, compute_capability=(9, 0), deterministic=False)
    q, k, v, grad_out = _inputs(1, 2, 2, 300, 256, 64, torch.bfloat16, "cpu")
    params = _params(300, 256, 64)
    out, lse = backend.forward(q, k, v, params)
    del recorded_maps[:]
    backend.backward(grad_out, q, k, v, out, lse, params)
    variant = launcher.calls[-1][0]
    assert variant.kernel == "hopper_bwd" and variant.define("QUERY_ROWS") == 128
    assert [rows for _, _, rows in recorded_maps] == [128, 128, 128, 128]  # q, k, v, grad_out


def test_cupy_launcher_launches_on_torchs_stream_in_the_tensors_device(monkeypatch):
    """CupyLauncher's prepared launch with CuPy replaced by stand-ins: the call's pointers in their places, the
    stream torch has current at each call, and a device switch only where the tensors' device is not current."""
    import sys
    import types

    from mhattn.backends.cupy import launcher as launcher_module
    from mhattn.backends.cupy.launcher import ArgumentTemplate, f32, i32, ptr, slot

    state = {"current": 0, "switches": 0}
    launched = []

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.previous, state["current"] = state["current"], self.index
            state["switches"] += self.index != self.previous

        def __exit__(self, *exc):
            state["current"] = self.previous

    class Function:
        def __call__(self, grid, block, args, shared_mem, stream):
            launched.append(dict(device=state["current"], grid=grid, block=block, args=args, smem=shared_mem,
                                 stream=stream.ptr))

    cuda = types.SimpleNamespace(Device=Device, runtime=types.SimpleNamespace(getDevice=lambda: state["current"]))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(launcher_module, "_CUPY_VALUE", [None])  # numpy scalars: readable on any CuPy
    streams = {1: 0xABC}
    monkeypatch.setattr(launcher_module, "current_stream", lambda index: streams[index])
    cupy_launcher = launcher_module.CupyLauncher()
    variant = variants.fwd_variant((9, 0), "bfloat16", 64, "plain")
    cupy_launcher._kernels[(variant, 1)] = types.SimpleNamespace(kernel=Function())
    template = ArgumentTemplate([slot(1), i32(5), slot(0), f32(0.5)])
    launch = cupy_launcher.prepare(variant, [3, 2, 1], template, torch.device("cuda", 1), (9, 0))
    switches = state["switches"]
    launch((100, 200))
    assert state["switches"] == switches + 1 and state["current"] == 0  # switched for the launch, then back
    state["current"], streams[1] = 1, 0xDEF
    launch((300, 400))
    assert state["switches"] == switches + 1  # already current: no switch
    assert [x["device"] for x in launched] == [1, 1] and [x["stream"] for x in launched] == [0xABC, 0xDEF]
    assert launched[0]["grid"] == (3, 2, 1) and launched[0]["block"] == (variant.num_threads,)
    assert launched[0]["smem"] == variant.smem_bytes
    assert [int(a) for a in launched[0]["args"]] == [200, 5, 100, 0] and float(launched[1]["args"][3]) == 0.5
    assert [int(a) for a in launched[1]["args"]] == [400, 5, 300, 0]
    cupy_launcher.launch(variant, (1, 1, 1), [ptr(None), i32(3)], torch.device("cuda", 1), (9, 0))  # one-off launch
    assert [int(a) for a in launched[-1]["args"]] == [0, 3]


# ---- GPU -----------------------------------------------------------------------------------------------------------


def _gpu_missing():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() < (8, 0):
        return "needs compute capability 8.0 or newer"
    try:
        import cupy  # noqa: F401
    except Exception as error:
        return f"needs cupy: {error}"
    return None


gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(_gpu_missing() is not None, reason=str(_gpu_missing()))


@pytest.fixture(scope="module")
def gpu_backend():
    return CupyBackend()


GPU_CASES = []
for _dtype in (torch.float16, torch.bfloat16):
    for _d in (32, 40, 64, 96, 128, 256):
        GPU_CASES.append(dict(name=f"d{_d}", dtype=_dtype, shape=(2, 3, 3, 113, 203, _d)))
    GPU_CASES += [
        dict(name="causal_tl", dtype=_dtype, shape=(2, 4, 4, 256, 512, 64), causal="top_left"),
        dict(name="causal_br", dtype=_dtype, shape=(2, 4, 4, 256, 512, 128), causal="bottom_right"),
        dict(name="causal_br_empty_rows", dtype=_dtype, shape=(1, 2, 2, 512, 256, 64), causal="bottom_right"),
        dict(name="causal_tl_long_q", dtype=_dtype, shape=(1, 2, 2, 1024, 1023, 128), causal="top_left"),
        dict(name="gqa", dtype=_dtype, shape=(2, 6, 2, 128, 217, 64)),
        dict(name="mqa_causal", dtype=_dtype, shape=(1, 6, 1, 1023, 1024, 128), causal="bottom_right"),
        dict(name="keypad_mask", dtype=_dtype, shape=(3, 4, 4, 108, 256, 64), keypad=True),
        dict(name="bool_mask", dtype=_dtype, shape=(1, 2, 2, 113, 211, 96), bool_mask=True),
        # boolean masks on the Hopper kernels (sm_90): a full mask with a row that sees nothing, and key padding
        dict(name="bool_mask_d128_causal", dtype=_dtype, shape=(2, 4, 2, 300, 333, 128), bool_mask=True,
             causal="bottom_right"),
        dict(name="keypad_d256", dtype=_dtype, shape=(2, 2, 2, 200, 260, 256), keypad=True),
        # float masks on the Hopper kernels: a (B, 1, Nq, Nk) bias with -inf places and a hidden row, and an
        # additive key padding bias (B, 1, 1, Nk) as Hugging Face models pass it (0 or the dtype's minimum)
        dict(name="float_mask_d128_causal", dtype=_dtype, shape=(2, 4, 2, 300, 333, 128), float_mask=True,
             causal="bottom_right"),
        dict(name="float_pad_d64", dtype=_dtype, shape=(2, 4, 4, 256, 300, 64), float_pad=True),
        dict(name="window", dtype=_dtype, shape=(1, 2, 2, 300, 300, 64), window=(37, 11)),
        dict(name="window_causal", dtype=_dtype, shape=(1, 2, 1, 300, 400, 128), window=(64, None),
             causal="bottom_right"),
        dict(name="strided", dtype=_dtype, shape=(2, 4, 4, 257, 257, 64), strided=True, causal="top_left"),
        dict(name="dropout", dtype=_dtype, shape=(2, 3, 3, 128, 217, 64), dropout_p=0.17),
        dict(name="grad_lse", dtype=_dtype, shape=(1, 2, 2, 200, 200, 128), grad_lse=True),
        dict(name="gqa_causal_d128", dtype=_dtype, shape=(2, 4, 2, 300, 333, 128), causal="top_left"),
        dict(name="d256_causal", dtype=_dtype, shape=(1, 2, 1, 300, 333, 256), causal="bottom_right"),
        dict(name="one_row", dtype=_dtype, shape=(1, 2, 2, 1, 513, 64)),
        # every key in one CTA of the Hopper backward (dQ stored directly): rows that see no key (zeros written by
        # the kernel), GQA, a window leaving query blocks out, a mask with hidden rows, a softcap with key padding,
        # and strided views (dQ not contiguous: the float32 accumulator)
        dict(name="one_key_block_br_empty_rows", dtype=_dtype, shape=(1, 4, 4, 200, 100, 64), causal="bottom_right"),
        dict(name="one_key_block_gqa_d128", dtype=_dtype, shape=(2, 8, 2, 128, 128, 128), causal="top_left"),
        dict(name="one_key_block_window", dtype=_dtype, shape=(1, 2, 2, 300, 120, 64), window=(20, 5)),
        dict(name="one_key_block_bool_mask", dtype=_dtype, shape=(2, 2, 2, 77, 100, 128), bool_mask=True),
        dict(name="one_key_block_softcap_keypad", dtype=_dtype, shape=(2, 4, 4, 96, 128, 64), keypad=True,
             softcap=3.0),
        dict(name="one_key_block_strided", dtype=_dtype, shape=(2, 4, 4, 100, 100, 64), strided=True),
        dict(name="overflow_scale", dtype=_dtype, shape=(1, 2, 2, 128, 128, 64), overflow=True),
        # feature variants
        dict(name="softcap_causal", dtype=_dtype, shape=(2, 4, 2, 300, 333, 128), causal="bottom_right", softcap=5.0),
        dict(name="softcap_d64", dtype=_dtype, shape=(1, 4, 4, 256, 217, 64), softcap=2.0),
        dict(name="float_mask_grad", dtype=_dtype, shape=(2, 4, 2, 113, 211, 64), float_mask=True, mask_grad=True),
        dict(name="float_mask_d256", dtype=_dtype, shape=(1, 2, 1, 300, 333, 256), float_mask=True,
             causal="top_left"),
        dict(name="value_dim", dtype=_dtype, shape=(2, 4, 2, 256, 300, 128), d_v=64),
        dict(name="value_dim_up", dtype=_dtype, shape=(1, 3, 3, 113, 203, 40), d_v=200, causal="top_left"),
        dict(name="odd_dim", dtype=_dtype, shape=(2, 3, 3, 113, 203, 59)),
        dict(name="odd_dim_strided", dtype=_dtype, shape=(1, 4, 4, 257, 257, 111), strided=True, causal="top_left"),
        dict(name="dim_1", dtype=_dtype, shape=(1, 2, 2, 128, 128, 1)),
        # every feature at once, but the lse gradient (refused with a float mask: see the test below)
        dict(name="everything", dtype=_dtype, shape=(2, 4, 2, 200, 230, 20), d_v=37, softcap=3.0, float_mask=True,
             mask_grad=True, dropout_p=0.17, causal="bottom_right"),
    ]


@gpu
@needs_gpu
@pytest.mark.parametrize("shape", [(1, 16, 16, 128, 128, 64), (2, 8, 2, 1024, 1024, 128)], ids=["small", "gqa-1k"])
def test_gpu_output_only_forward_matches_forward(gpu_backend, poisoned, shape):
    """mhattn.attention on the CuPy backend for a call that needs no gradient and returns no lse (native_call: the
    lse in a kept scratch view) gives bitwise the backend's forward output, first and repeated calls, on the mma.sync
    kernels and, on sm_90, the Hopper forward."""
    import mhattn

    batch, hq, hkv, nq, nk, d = shape
    for seed in range(2):
        q, k, v, _ = _inputs(batch, hq, hkv, nq, nk, d, torch.bfloat16, "cuda", seed=seed)
        want, _ = gpu_backend.forward(q, k, v, _params(nq, nk, d, causal="top_left"))
        got = mhattn.attention(q, k, v, is_causal=True, enable_gqa=hq != hkv, backend="cupy")
        assert torch.equal(got, want), f"seed {seed}"


@gpu
@needs_gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fast"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c['name']}-{str(c['dtype'])[6:]}")
def test_gpu_matches_reference(gpu_backend, poisoned, case, deterministic):
    batch, hq, hkv, nq, nk, d = case["shape"]
    q, k, v, grad_out = _inputs(batch, hq, hkv, nq, nk, d, case["dtype"], "cuda", strided=case.get("strided", False),
                                d_v=case.get("d_v"))
    if case.get("overflow"):
        q, k = q * 5, k * 3
    gen = torch.Generator().manual_seed(3)
    mask = None
    if case.get("keypad"):
        mask = (torch.rand(batch, 1, 1, nk, generator=gen) > 0.25).cuda().expand(batch, hq, nq, nk)
    if case.get("bool_mask"):
        mask = (torch.rand(1, hq, nq, nk, generator=gen) > 0.5).cuda()
        mask[:, :, 7] = False  # fully masked rows
        mask = mask.expand(batch, hq, nq, nk)
    if case.get("float_mask"):
        mask = _float_mask(batch, hq, nq, nk, case["dtype"], "cuda")
    if case.get("float_pad"):
        keep = torch.rand(batch, 1, 1, nk, generator=gen) > 0.25
        mask = torch.zeros(batch, 1, 1, nk).masked_fill(~keep, torch.finfo(case["dtype"]).min)
        mask = mask.to(case["dtype"]).cuda().expand(batch, hq, nq, nk)
    params = _params(nq, nk, d, causal=case.get("causal"), window=case.get("window"), mask=mask,
                     dropout_p=case.get("dropout_p", 0.0), seed=(2024, 77), softcap=case.get("softcap"),
                     mask_requires_grad=case.get("mask_grad", False))
    grad_lse = torch.randn(batch, hq, nq, device="cuda") if case.get("grad_lse") else None
    gpu_backend.deterministic = deterministic
    try:
        failures = _check(gpu_backend, q, k, v, grad_out, params, grad_lse)
    finally:
        gpu_backend.deterministic = None
    assert not failures, failures


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_dropout_keep_mask_is_the_shared_rng(gpu_backend, dtype):
    # With q = 0 every visible key gets P = 1/Nk; with V = identity (d = Nk) the output row i is
    # keep[i, :] / (Nk (1 - p)), which exposes the kernel's keep mask bit for bit.
    batch, heads, nq, nk, p = 2, 3, 100, 64, 0.3
    q = torch.zeros(batch, heads, nq, nk, dtype=dtype, device="cuda")
    k = torch.randn(batch, heads, nk, nk, dtype=dtype, device="cuda")
    v = torch.eye(nk, dtype=dtype, device="cuda").expand(batch, heads, nk, nk)
    params = AttentionParams(scale=0.125, dropout_p=p, seed=(0xDEADBEEF, 0x12345678))
    out, _ = gpu_backend.forward(q, k, v, params)
    kernel_keep = out.float() * nk * (1 - p) > 0.5
    expected = keep_mask(params.seed, batch, heads, nq, nk, p, device="cuda")
    assert torch.equal(kernel_keep, expected)
    assert torch.equal(gpu_backend.dropout_keep_mask(batch, heads, nq, nk, params, "cuda"), expected)


@gpu
@needs_gpu
@pytest.mark.parametrize("d", [64, 128, 256, "features", "window_gqa", "long"])
def test_gpu_backward_is_deterministic(d, monkeypatch):
    # asked for through torch, as users do; the default backward (atomic dQ) need not be reproducible. On sm_90 d =
    # 64 and 128 run the Hopper backward with its key blocks adding dQ in turns; "long" has more key blocks a head
    # (256) than the H100 has SMs, the grid that would deadlock if a CTA waited for one started after it.
    backend = CupyBackend()
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    if d == "features":  # softcap, float mask with its gradient, odd head dims
        q, k, v, grad_out = _inputs(2, 4, 2, 1000, 1000, 59, torch.bfloat16, "cuda", d_v=77)
        params = _params(1000, 1000, 59, causal="top_left", softcap=4.0, mask_requires_grad=True,
                         mask=_float_mask(2, 4, 1000, 1000, torch.bfloat16, "cuda"))
    elif d == "window_gqa":
        q, k, v, grad_out = _inputs(2, 6, 2, 1100, 1300, 64, torch.float16, "cuda")
        params = _params(1100, 1300, 64, causal="bottom_right", window=(300, None))
    elif d == "long":
        q, k, v, grad_out = _inputs(1, 2, 2, 2048, 32768, 128, torch.bfloat16, "cuda")
        params = _params(2048, 32768, 128)
    else:
        q, k, v, grad_out = _inputs(2, 4, 2, 1000, 1000, d, torch.bfloat16, "cuda")
        params = _params(1000, 1000, d, causal="top_left")
    out, lse = backend.forward(q, k, v, params)
    first = backend.backward(grad_out, q, k, v, out, lse, params)
    for _ in range(50):
        again = backend.backward(grad_out, q, k, v, out, lse, params)
        assert all(a is b or torch.equal(a, b) for a, b in zip(first, again))


def test_backward_is_fast_unless_determinism_is_asked_for(monkeypatch):
    monkeypatch.delenv("MHATTN_CUPY_FAST_BACKWARD", raising=False)
    assert CupyBackend()._deterministic() is False
    assert CupyBackend(deterministic=True)._deterministic() is True
    monkeypatch.setenv("MHATTN_CUPY_FAST_BACKWARD", "0")
    assert CupyBackend()._deterministic() is True
    assert CupyBackend(deterministic=False)._deterministic() is False
    monkeypatch.setenv("MHATTN_CUPY_FAST_BACKWARD", "1")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert CupyBackend()._deterministic() is True


@gpu
@needs_gpu
def test_gpu_stream_graph_and_cupy_pool(gpu_backend):
    import cupy

    q, k, v, _ = _inputs(1, 4, 4, 512, 512, 64, torch.bfloat16, "cuda")
    params = _params(512, 512, 64, causal="top_left")
    expected, _ = gpu_backend.forward(q, k, v, params)
    pool = cupy.get_default_memory_pool()
    used_before = pool.total_bytes()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # launched on torch's current stream, so ordered with torch's work there
        for _ in range(3):
            on_side, _ = gpu_backend.forward(q, k, v, params)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = gpu_backend.forward(q, k, v, params)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)
    assert pool.total_bytes() == used_before  # every buffer came from torch's allocator


@gpu
@needs_gpu
def test_gpu_through_mhattn_attention():
    import mhattn

    q, k, v, grad_out = _inputs(2, 8, 2, 300, 300, 64, torch.bfloat16, "cuda")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = mhattn.attention(*leaves, is_causal=True, enable_gqa=True, backend="cupy")
    out.backward(grad_out)
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = mhattn.attention(*ref, is_causal=True, enable_gqa=True, backend="reference")
    expected.backward(grad_out)
    assert (out.float() - expected.float()).abs().max() < 2e-2
    for got, want in zip(leaves, ref):
        assert (got.grad.float() - want.grad.float()).abs().max() < 5e-2


def test_float_mask_with_an_lse_gradient_is_refused_clearly():
    """The backward refuses a gradient into the lse together with a float mask (it gave NaN on the H100)."""
    from mhattn.backends.cupy import ops
    from mhattn.errors import BackendUnavailableError

    q = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    params = _params(8, 8, 16, mask=torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16))
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(BackendUnavailableError, match="lse together with a float attn_mask"):
        ops.backward(None, (9, 0), q, q, q, q, q, lse, params, grad_lse=lse)
