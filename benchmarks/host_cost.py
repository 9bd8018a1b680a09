"""Host cost of the call path on the CPU, no GPU needed: microseconds and Python function calls per call.

    python benchmarks/host_cost.py            # the table below
    python benchmarks/host_cost.py --profile fwd|fwd_bwd|triton|triton_out|triton_bwd|decode|decode_prepared|kvcache|
                                             cupy|cupy_bwd|causal_bias|auto

Rows (B=1 H=16 N=128 d=64, CPU tensors, so nothing here waits for a kernel):
- mhattn.attention forward / forward+backward on a backend that does no work (``null``: allocates its
  outputs, launches nothing): the front end's own cost (checks, request, decision cache, autograd);
- the Triton backend's host code for one forward / backward with the compiled kernels' launchers replaced by
  no-ops (plan, scalars, grid, argument tuples, the compiled-handle look-up of launcher.py), the same forward
  as mhattn.attention runs it for calls that return no lse and need no gradient (its output alone, the lse written
  into a kept scratch buffer: TritonBackend.native_call), and for one split-KV decoding step (B=1, 32 query heads
  on 8 key/value heads, Nq=1, Nk=1k, d=128, bf16): the backend's forward, the step mhattn.attention runs for an
  untracked call that returns no lse (native_call, its first call's launches kept), and attention_with_kvcache
  appending one token to a cache of 1088 rows through the Triton backend (its prepared step; float16);
- the CuPy backend's host code for one forward / backward with a launcher that does nothing (plan look-up,
  allocations, data pointers up to the launcher), and with CuPy's launcher whose CuPy pieces do nothing (its
  stream look-up, device check and argument splice included); these take the sm_80 (mma.sync) plans, since
  the Hopper plans encode tensor maps through the GPU driver;
- mhattn.attention forward on the null backend with a ``causal_lower_right`` object for its mask (a chunked prefill,
  a speculative decoding step), with a key-padding mask (B, 1, 1, Nk), and with that mask and a causal window (-1, 0)
  (how the Hugging Face integration passes a padded batch): repeated calls the front end's memo serves (a mask tensor
  by its layout, a window by its values), as it does calls without a mask;
- torch's scaled_dot_product_attention at N = 1 (real work, but tiny), for scale, and mhattn.attention on the same
  tensors with the backend left to automatic selection (the sdpa backend hands the call to torch's public op):
  the difference of the two rows is what mhattn's front end adds to a repeated call.
The machine's other load moves these numbers: compare rows of one run, best of five repetitions.
"""

import argparse
import contextlib
import dataclasses
import cProfile
import pstats
import time

import torch
from torch.nn.attention.bias import causal_lower_right

import mhattn
from mhattn.backends.base import FEATURES, AttentionParams, Backend, Capabilities

SHAPE = (1, 16, 128, 64)


class NullBackend(Backend):
    """Allocates outputs in the layouts of the built-in backends and computes nothing."""

    name = "null"
    capabilities = Capabilities(device_types=frozenset({"cpu"}), dtypes=frozenset({torch.float32, torch.bfloat16}),
                                min_compute_capability=None, features=frozenset(FEATURES))

    def forward(self, q, k, v, params):
        batch, heads, seqlen, _ = q.shape
        out = torch.empty(batch, seqlen, heads, v.shape[-1], dtype=q.dtype).transpose(1, 2)
        return out, torch.empty(batch, heads, seqlen)

    def backward(self, grad_out, q, k, v, out, lse, params, grad_lse=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class _StubCompiled:
    """A compiled kernel whose launcher does nothing."""

    function = packed_metadata = None

    def run(self, *args):
        pass


class _StubKernel:
    """A Triton kernel's parameter list with a launch that does nothing: ``kernel[grid](...)`` returns a
    stub handle, so the backend's own launcher (key, handle look-up, argument tuple) runs as on a GPU."""

    def __init__(self, kernel):
        from triton.runtime.jit import JITFunction

        self.params = kernel.params if hasattr(kernel, "params") else JITFunction(kernel.fn).params
        self.__name__ = getattr(kernel, "__name__", "kernel")

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _StubCompiled()


class _NoLauncher:
    """Launches nothing: the CuPy backend's host code up to its launcher (prepared launches do nothing)."""

    def launch(self, *args, **kwargs):
        pass

    def prepare(self, *args, **kwargs):
        return _no_launch


def _no_launch(pointers):
    pass


@contextlib.contextmanager
def stubbed_cupy():
    """A CupyLauncher whose CuPy pieces (device, runtime, the kernel function) are stand-ins that do nothing and
    whose stream is 0: its own per-launch work (stream look-up, device check, argument splice) runs as on a GPU,
    up to the call into CuPy. The CuPy backend on it, for CPU tensors."""
    import sys
    from types import SimpleNamespace

    from mhattn.backends.cupy import CupyBackend
    from mhattn.backends.cupy import launcher as launcher_module

    class Device:
        def __init__(self, index):
            pass

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            pass

    def no_function(grid, block, args, shared_mem, stream):
        pass

    class StubbedLauncher(launcher_module.CupyLauncher):
        def kernel(self, variant, device_index, cc):
            return SimpleNamespace(kernel=no_function)

        def prepare(self, variant, grid, template, device, cc):
            return super().prepare(variant, grid, template, torch.device("cuda", 0), cc)

    fake = SimpleNamespace(cuda=SimpleNamespace(Device=Device, runtime=SimpleNamespace(getDevice=lambda: 0)))
    saved = sys.modules.get("cupy"), launcher_module.current_stream, launcher_module._CUPY_VALUE[:]
    sys.modules["cupy"] = fake
    launcher_module.current_stream = lambda index: 0
    try:
        yield CupyBackend(launcher=StubbedLauncher(), compute_capability=(8, 0))
    finally:
        if saved[0] is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved[0]
        launcher_module.current_stream = saved[1]
        launcher_module._CUPY_VALUE[:] = saved[2]


def per_call_us(fn, calls=2000, repeats=5) -> float:
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def python_calls(fn) -> int:
    fn()
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return pstats.Stats(profile).total_calls


@contextlib.contextmanager
def stubbed_triton():
    from types import SimpleNamespace

    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import launcher as launcher_module

    from mhattn.backends.triton import decode as decode_module

    forward_module, backward_module, _ = triton_backend.kernels()
    stubs = triton_backend._Launchers(
        SimpleNamespace(attention_forward_kernel=_StubKernel(forward_module.attention_forward_kernel)),
        SimpleNamespace(**{name: _StubKernel(getattr(backward_module, name)) for name in (
            "backward_preprocess_kernel", "backward_dkdv_kernel", "backward_dq_kernel", "backward_short_kernel")}),
        SimpleNamespace(**{name: _StubKernel(getattr(decode_module, name)) for name in (
            "split_kv_kernel", "combine_splits_kernel", "append_kv_kernel")}))
    for launcher in vars(stubs).values():
        launcher.interpret = False
    saved = triton_backend.launchers, launcher_module.current_stream
    triton_backend.launchers = lambda: stubs
    launcher_module.current_stream = lambda index: 0
    try:
        yield triton_backend.TritonBackend()
    finally:
        triton_backend.launchers, launcher_module.current_stream = saved


def decoding_steps(triton):
    """Split-KV decoding steps on the stubbed Triton backend (CPU tensors get past the backend's device check as under
    the interpreter; the launches themselves are the stubs): the backend's forward, the step mhattn.attention runs for
    an untracked call (native_call: its first call's launches kept), and a KV-cache step through
    attention_with_kvcache appending one token (the step kvcache_call prepares)."""
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import decode_launch

    q = torch.randn(1, 32, 1, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 1024, 128, dtype=torch.bfloat16)
    # The KV-cache step in float16 (the interpreter's flag refuses bfloat16 on CPU tensors) through
    # attention_with_kvcache, on a registered Triton backend that declares CPU tensors (as it does under that flag).
    q16 = q.half()
    k_cache, v_cache = (torch.randn(1, 8, 1088, 128, dtype=torch.float16) for _ in range(2))
    new_k, new_v = (torch.randn(1, 8, 1, 128, dtype=torch.float16) for _ in range(2))
    lengths = torch.tensor([1023], dtype=torch.int32)
    params = AttentionParams(scale=128 ** -0.5, diag_offset=1023, window_right=0)
    prepared = triton.native_call(q, k, k, params)
    class TritonOnCpu(triton_backend.TritonBackend):
        name = "triton-on-cpu"
        capabilities = dataclasses.replace(triton_backend.TritonBackend.capabilities,
                                           device_types=frozenset({"cuda", "cpu"}))

    on_cpu = TritonOnCpu()
    on_cpu._unavailable = []  # (its launches are the stubs: no GPU needed)
    mhattn.register_backend(on_cpu, replace=True)

    def interpreted(call):
        def step():
            saved = triton_backend.INTERPRET, decode_launch._sm_count
            triton_backend.INTERPRET, decode_launch._sm_count = True, lambda index: 132
            try:
                return call()
            finally:
                triton_backend.INTERPRET, decode_launch._sm_count = saved
        return step

    return (interpreted(lambda: triton.forward(q, k, k, params)), interpreted(lambda: prepared(q, k, k, params)),
            interpreted(lambda: mhattn.attention_with_kvcache(q16, k_cache, v_cache, new_k, new_v, lengths,
                                                              backend="triton-on-cpu")))


def rows():
    q, k, v = (torch.randn(*SHAPE) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def fwd():
        return mhattn.attention(q, k, v, is_causal=True, backend="null")

    def fwd_bwd():
        out = mhattn.attention(qg, kg, vg, is_causal=True, backend="null")
        torch.autograd.grad(out, (qg, kg, vg), out)  # no accumulation into .grad: the call path alone

    params = AttentionParams(scale=0.125, window_right=0)
    out, lse = NullBackend().forward(q, k, v, params)
    table = [("mhattn.attention forward, null backend", fwd),
             ("mhattn.attention forward+backward, null backend", fwd_bwd)]
    from mhattn.backends.cupy import CupyBackend

    cupy = CupyBackend(launcher=_NoLauncher(), compute_capability=(8, 0))
    qh, kh, vh = (t.to(torch.bfloat16) for t in (q, k, v))
    out_h, lse_h = cupy.forward(qh, kh, vh, params)
    table += [("cupy backend forward, host code only", lambda: cupy.forward(qh, kh, vh, params)),
              ("cupy backend backward, host code only",
               lambda: cupy.backward(out_h, qh, kh, vh, out_h, lse_h, params))]
    lower_right = causal_lower_right(q.shape[2], k.shape[2])
    table.append(("mhattn.attention forward, causal_lower_right, null", lambda: mhattn.attention(
        q, k, v, attn_mask=lower_right, backend="null")))
    padding = (torch.arange(k.shape[2]) >= 10).view(1, 1, 1, k.shape[2])
    table.append(("mhattn.attention forward, key-padding mask, null", lambda: mhattn.attention(
        q, k, v, attn_mask=padding, backend="null")))
    table.append(("  the same with a causal window (-1, 0), null", lambda: mhattn.attention(
        q, k, v, attn_mask=padding, window=(-1, 0), backend="null")))
    sdpa_q = q[:, :, :1]
    table.append(("torch sdpa at N = 1 (for scale)",
                  lambda: torch.nn.functional.scaled_dot_product_attention(sdpa_q, sdpa_q, sdpa_q)))
    table.append(("mhattn.attention forward on auto (sdpa) at N = 1", lambda: mhattn.attention(sdpa_q, sdpa_q, sdpa_q)))
    return table, (q, k, v, out, lse, params)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=("fwd", "fwd_bwd", "triton", "triton_out", "triton_bwd", "decode",
                                              "decode_prepared", "kvcache", "cupy", "cupy_bwd", "causal_bias",
                                              "key_padding", "key_padding_window", "auto"),
                        default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # no intra-op thread pool in the numbers
    mhattn.register_backend(NullBackend(), replace=True)
    table, (q, k, v, out, lse, params) = rows()
    with stubbed_triton() as triton, stubbed_cupy() as cupy:
        qh, kh, vh = (t.to(torch.bfloat16) for t in (q, k, v))
        out_h, lse_h = cupy.forward(qh, kh, vh, params)
        table[4:4] = [("cupy backend forward, launcher's CuPy stubbed", lambda: cupy.forward(qh, kh, vh, params)),
                      ("cupy backend backward, launcher's CuPy stubbed",
                       lambda: cupy.backward(out_h, qh, kh, vh, out_h, lse_h, params))]
        output_only = triton.native_call(q, k, v, params)  # no input requires grad: the forward's output alone
        table[2:2] = [("triton backend forward, launches stubbed", lambda: triton.forward(q, k, v, params)),
                      ("triton backend output only (lse in scratch), stubbed", lambda: output_only(q, k, v, params)),
                      ("triton backend backward, launches stubbed",
                       lambda: triton.backward(out, q, k, v, out, lse, params)),
                      ]
        forward_step, prepared_step, kvcache_step = decoding_steps(triton)
        table[5:5] = [("triton backend decoding step, launches stubbed", forward_step),
                      ("  the same step prepared (native_call), stubbed", prepared_step),
                      ("  attention_with_kvcache step, one appended, stubbed", kvcache_step)]
        if args.profile:
            fn = {"fwd": table[0][1], "fwd_bwd": table[1][1], "triton": table[2][1], "triton_out": table[3][1],
                  "triton_bwd": table[4][1], "decode": table[5][1], "decode_prepared": table[6][1],
                  "kvcache": table[7][1], "cupy": table[8][1], "cupy_bwd": table[9][1],
                  "causal_bias": table[-5][1], "key_padding": table[-4][1], "key_padding_window": table[-3][1],
                  "auto": table[-1][1]}[args.profile]
            for _ in range(100):  # first calls fill the caches (plans, decisions, handles): profile the steady state
                fn()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(1000):
                fn()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)
            return
        print(f"{'host cost per call (B=1 H=16 N=128 d=64, CPU)':<52} {'us':>7} {'Python calls':>13}")
        for label, fn in table:
            print(f"{label:<52} {per_call_us(fn):7.1f} {python_calls(fn):13d}")


if __name__ == "__main__":
    main()
