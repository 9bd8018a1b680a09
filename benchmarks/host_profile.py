"""Where the host time of a small attention call goes on a GPU machine (the GPU counterpart of host_cost.py).

    source benchmarks/device_env.sh && python benchmarks/host_profile.py            # the table
    python benchmarks/host_profile.py --profile triton-bwd                            # + cProfile of one path

Host loops (300 calls, one synchronize at the end, best of five) at B=1 H=16 N=128 d=64 bf16:
- torch's SDPA, and its fused kernels (cuDNN, flash, efficient) called as their own ops;
- mhattn.attention on auto and on each fused backend, forward and forward+backward;
- the Triton forward kernel launched through Triton (``kernel[grid](...)``) and through the compiled handle
  the backend keeps (backends/triton/launcher.py), with the same arguments;
- the Triton backend's forward and backward called directly on the main thread, an identity autograd
  Function's forward+backward (the autograd engine's own cost of a Python backward), and a Function whose
  backward calls the backend's backward (what mhattn's autograd Function pays on the engine's device thread).
``--single-thread`` repeats the rows with a backward with autograd's multithreading off
(``torch.autograd.set_multithreading_enabled(False)``: the engine runs every node on the calling thread), which
says what the hand-off to the engine's device thread costs each path.
``--bisect`` times the Triton forward+backward through four wrappers, from a bare autograd Function to
mhattn.attention, on autograd's device thread and on the calling thread. ``--paths`` shows, at the latency
shapes, which path auto takes beside torch's SDPA (call_paths).
``--gluon`` gives the host cost per call of the Gluon Hopper paths at the protocol's short causal cells (N = 1k,
B*N = 16k) beside their GPU time (gluon_host_costs). ``--torch-kernels`` times, at the three bf16 latency shapes,
torch's public SDPA beside each fused kernel called through its private op's Python binding (no per-call kernel choice;
a differentiable op, so forward+backward keeps torch's C++ autograd node) and mhattn on auto, in turns
(torch_kernel_rows). ``--relay`` times the Triton and CuPy backends' forward+backward through an autograd Function
(one node, on the device thread) beside a two-node relay that runs the same backward on the calling thread
(relay_functions). ``--device-thread`` times pieces of host work inside a backward
(autograd's device thread) beside the same on the main thread. ``--profile triton-fwd`` (``cupy-fwd``) prints
cProfile's top entries of mhattn.attention's forward on the Triton (CuPy) backend; ``--profile triton-bwd`` prints
cProfile's top entries of the Triton backward where autograd runs it (its device thread) and on the main thread.
Prints the table last.
"""

import argparse
import cProfile
import io
import pstats

import torch

import mhattn
from mhattn import functional
from mhattn.benchmark import latency
from mhattn.backends.base import AttentionParams

SHAPE = (1, 16, 128, 64)


def host_loop_us(fn, calls=300, repeats=5) -> float:
    for _ in range(20):
        fn()
    return latency.host_loop_us(fn, calls, "cuda", rounds=repeats)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad


def _backend_function(backend, params):
    """An autograd Function that runs ``backend``'s forward and backward and nothing else."""

    class Direct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = backend.forward(q, k, v, params)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, out, lse = ctx.saved_tensors
            return backend.backward(grad, q, k, v, out, lse, params)[:3]

    return Direct


def _saved_forward(ctx, backend, params, q, k, v):
    """(out, lse) of ``backend``'s forward inside an autograd Function's forward, with what its backward reads saved
    (q, k, v, out, lse) and unused output gradients left as None."""
    out, lse = backend.forward(q, k, v, params)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, lse)
    return out, lse


def _two_output_function(backend, params):
    """As _backend_function, but returning (out, lse) with lse unused and its gradient not materialised, and saving
    them as outputs: the shape of mhattn's own autograd Function (functional._EagerAttention) without the front end."""

    class TwoOutputs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return _saved_forward(ctx, backend, params, q, k, v)

        @staticmethod
        def backward(ctx, grad, grad_lse):
            q, k, v, out, lse = ctx.saved_tensors
            return backend.backward(grad, q, k, v, out, lse, params)[:3]

    return TwoOutputs


def bisect_rows(q, k, v, dout):
    """Forward+backward on the Triton backend through four wrappers, from the bare Function to mhattn.attention, so
    that a cost the device thread adds to one of them shows where it comes from."""
    triton = mhattn.registry.get_backend("triton")
    params = AttentionParams(scale=SHAPE[-1] ** -0.5)
    direct, two = _backend_function(triton, params), _two_output_function(triton, params)
    eager = functional._EagerAttention
    return [
        ("Function, one output", lambda: direct.apply(q, k, v).backward(dout)),
        ("Function, two outputs (out, lse)", lambda: two.apply(q, k, v)[0].backward(dout)),
        ("functional._EagerAttention.apply", lambda: eager.apply(q, k, v, None, params, triton)[0].backward(dout)),
        ("mhattn.attention(backend='triton')", lambda: mhattn.attention(q, k, v, backend="triton").backward(dout)),
    ]


def _triton_launch_rows(q, k, v, params):
    """The forward kernel through Triton's launch, through the kept handle and through the backend's prepared
    launch (launcher.PreparedLaunch), same arguments."""
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import launcher as launcher_module

    launcher = triton_backend.launchers().forward
    captured = {}
    original = launcher_module.PreparedLaunch.launch

    def spy(prepared, args):
        if prepared.launcher is launcher:
            captured.update(prepared=prepared, args=args)
        return original(prepared, args)

    launcher_module.PreparedLaunch.launch = spy
    try:
        mhattn.registry.get_backend("triton").forward(q, k, v, params)
    finally:
        launcher_module.PreparedLaunch.launch = original
    prepared, args = captured["prepared"], captured["args"]
    grid, sets, index = prepared.grid, prepared.constexprs, prepared.device_index
    return [("triton forward kernel, kernel[grid](...)", lambda: launcher._launch_through_triton(grid, args, sets)),
            ("triton forward kernel, kept handle", lambda: launcher.launch(grid, args, sets, index)),
            ("triton forward kernel, prepared launch", lambda: prepared.launch(args))]


def rows():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
               for _ in range(3))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    dout = torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16, generator=gen)
    params = AttentionParams(scale=SHAPE[-1] ** -0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    table = [("torch sdpa forward", lambda: sdpa(qd, kd, vd)),
             ("torch sdpa forward+backward", lambda: sdpa(q, k, v).backward(dout))]
    table += _fused_op_rows(q, k, v, dout)
    names = ["auto"] + [b.name for b in mhattn.registry.all_backends()
                        if b.name in ("triton", "cupy", "sdpa") and not b.unavailable()]
    for name in names:
        table.append((f"mhattn {name} forward", lambda name=name: mhattn.attention(qd, kd, vd, backend=name)))
        table.append((f"mhattn {name} forward+backward",
                      lambda name=name: mhattn.attention(q, k, v, backend=name).backward(dout)))
    if "triton" in names:
        triton = mhattn.registry.get_backend("triton")
        out, lse = triton.forward(qd, kd, vd, params)
        table.append(("triton backend forward, main thread", lambda: triton.forward(qd, kd, vd, params)))
        table += _triton_launch_rows(qd, kd, vd, params)
        table.append(("torch.empty_strided x2 (the forward's out, lse)", lambda: (
            torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device),
            torch.empty_strided(lse.shape, lse.stride(), dtype=lse.dtype, device=lse.device))))
        table.append(("identity autograd Function forward+backward", lambda: _Identity.apply(q).backward(dout)))
    for name in ("triton", "cupy"):
        if name not in names:
            continue
        backend = mhattn.registry.get_backend(name)
        out, lse = backend.forward(qd, kd, vd, params)
        table.append((f"{name} backend forward+backward, main thread", lambda backend=backend, out=out, lse=lse: (
            backend.forward(qd, kd, vd, params), backend.backward(dout, qd, kd, vd, out, lse, params))))
        direct = _backend_function(backend, params)
        table.append((f"autograd Function of the {name} backend forward+backward",
                      lambda direct=direct: direct.apply(q, k, v).backward(dout)))
    return table, (q, k, v, dout)


def _fused_op_rows(q, k, v, dout):
    """torch's fused SDPA kernels called as their own ops (what the public op runs after choosing one), forward and
    forward+backward: the host time the public op's choice and checks add."""
    qd, kd, vd = (t.detach() for t in (q, k, v))
    ops = {
        "cudnn": lambda q, k, v, grad: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, grad)[0],
        "flash": lambda q, k, v, grad: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0],
        "efficient": lambda q, k, v, grad: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None,
                                                                                                  grad)[0],
    }
    rows = []
    for name, op in ops.items():
        try:
            op(q, k, v, True).backward(dout)
        except Exception as error:  # a kernel this torch or GPU lacks
            print(f"torch {name} op: {type(error).__name__}: {str(error)[:120]}")
            continue
        rows.append((f"torch {name} op forward", lambda op=op: op(qd, kd, vd, False)))
        rows.append((f"torch {name} op forward+backward", lambda op=op: op(q, k, v, True).backward(dout)))
    return rows


def bf16_latency_shapes():
    """(shape, (B, H, N, D)) of each bf16 shape of ``mhattn bench --latency`` (latency.SHAPES)."""
    for shape in latency.SHAPES:
        if shape.dtype == "bf16":
            yield shape, (shape.batch, shape.heads, shape.seqlen, shape.head_dim)


def call_paths():
    """At each bf16 shape of ``mhattn bench --latency``: the kernel torch's SDPA picks (torch._fused_sdp_choice) with
    and without an explicit scale, for inputs with and without a gradient; the autograd node of mhattn.attention's
    output on auto beside SDPA's (mhattn's own Function, or torch's node when auto hands the call to torch's public
    op); host loops of SDPA, SDPA with scale=, torch's private cuDNN op (what the public op runs after its per-call
    kernel choice), and mhattn on auto, forward and forward+backward; and cProfile's top entries of 300 auto
    forwards."""
    for shape, dims in bf16_latency_shapes():
        q, k, v = (torch.randn(*dims, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        qd, kd, vd = (t.detach() for t in (q, k, v))
        dout = torch.randn_like(qd)
        scale = shape.head_dim ** -0.5
        sdpa = torch.nn.functional.scaled_dot_product_attention
        choices = {f"{'grad' if t[0].requires_grad else 'no grad'}{', scale=' if kw else ''}":
                   int(torch._fused_sdp_choice(*t, **kw)) for t in ((q, k, v), (qd, kd, vd))
                   for kw in ({}, {"scale": scale})}
        nodes = (type(mhattn.attention(q, k, v).grad_fn).__name__, type(sdpa(q, k, v).grad_fn).__name__)
        print(f"== {shape.describe()}\ntorch's choice (SDPBackend value): {choices}\n"
              f"autograd node: mhattn auto {nodes[0]}, torch sdpa {nodes[1]}")
        cudnn_op = torch._scaled_dot_product_cudnn_attention
        for label, fn in (("torch sdpa forward", lambda: sdpa(qd, kd, vd)),
                          ("torch sdpa, scale=, forward", lambda: sdpa(qd, kd, vd, scale=scale)),
                          ("torch cuDNN op, scale=, forward",
                           lambda: cudnn_op(qd, kd, vd, None, False, 0.0, False, False, scale=scale)[0]),
                          ("mhattn auto forward", lambda: mhattn.attention(qd, kd, vd)),
                          ("torch sdpa forward (again: the host's drift)", lambda: sdpa(qd, kd, vd)),
                          ("torch sdpa forward+backward", lambda: sdpa(q, k, v).backward(dout)),
                          ("torch sdpa, scale=, forward+backward", lambda: sdpa(q, k, v, scale=scale).backward(dout)),
                          ("mhattn auto forward+backward", lambda: mhattn.attention(q, k, v).backward(dout))):
            print(f"{label:<52} {host_loop_us(fn):8.1f} us host loop")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(300):
            mhattn.attention(qd, kd, vd)
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(8)
        print(text.getvalue())


def profile_forward(q, k, v, backend):
    """cProfile of mhattn.attention's forward on one backend (no gradient), 300 calls."""
    qd, kd, vd = (t.detach() for t in (q, k, v))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        mhattn.attention(qd, kd, vd, backend=backend)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
    print(f"== mhattn.attention forward on {backend} x300\n{text.getvalue()}")


def profile_triton_backward(q, k, v, dout):
    """cProfile of the Triton backward on autograd's device thread, then the same calls on the main thread."""
    worker = cProfile.Profile()
    original = functional._run_backward

    def profiled(*args, **kwargs):
        worker.enable()  # cProfile follows the thread that enables it: here, the engine's device thread
        try:
            return original(*args, **kwargs)
        finally:
            worker.disable()

    functional._run_backward = profiled
    try:
        for _ in range(300):
            mhattn.attention(q, k, v, backend="triton").backward(dout)
        torch.cuda.synchronize()
    finally:
        functional._run_backward = original
    triton = mhattn.registry.get_backend("triton")
    params = AttentionParams(scale=SHAPE[-1] ** -0.5)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = triton.forward(qd, kd, vd, params)
    main = cProfile.Profile()
    main.enable()
    for _ in range(300):
        triton.backward(dout, qd, kd, vd, out, lse, params)
    main.disable()
    torch.cuda.synchronize()
    for label, prof in (("autograd's device thread", worker), ("main thread", main)):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        print(f"== triton backward x300 on {label}\n{text.getvalue()}")


def device_thread_pieces(q, k, v, dout, calls=200):
    """Median microseconds of pieces of host work run inside a backward (on autograd's device thread) and on the
    main thread: a pure-Python loop, CUDA allocations, tensor attribute reads, the Triton backend's forward and
    backward. Which of them slow down on the device thread says whether Python itself or the state it touches
    (the CUDA driver's, the allocator's, Triton's) is slower there."""
    import time

    triton = mhattn.registry.get_backend("triton")
    params = AttentionParams(scale=SHAPE[-1] ** -0.5)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = triton.forward(qd, kd, vd, params)

    def python_loop():
        total = 0
        for i in range(300):
            total += i
        return total

    pieces = {
        "pure-Python loop (300 adds)": python_loop,
        "10 CUDA allocations": lambda: [torch.empty(16, device="cuda") for _ in range(10)],
        "50 reads of shape, strides, dtype": lambda: [(qd.shape, qd.stride(), qd.dtype) for _ in range(50)],
        "triton backend forward": lambda: triton.forward(qd, kd, vd, params),
        "triton backend backward": lambda: triton.backward(dout, qd, kd, vd, out, lse, params),
    }
    times = {name: ([], []) for name in pieces}

    def run_pieces(slot):
        for name, fn in pieces.items():
            start = time.perf_counter()
            fn()
            times[name][slot].append(time.perf_counter() - start)

    class Probe(_Identity):  # the identity, whose backward also times the pieces on the engine's thread
        @staticmethod
        def backward(ctx, grad):
            run_pieces(0)
            return grad

    for fn in pieces.values():
        fn()
    for _ in range(calls):
        Probe.apply(q).backward(dout)
        run_pieces(1)
    torch.cuda.synchronize()
    median = lambda xs: sorted(xs)[len(xs) // 2] * 1e6  # noqa: E731
    print(f"{'median us per piece (B=1 H=16 N=128 d=64 bf16)':<52} {'device thread':>14} {'main thread':>12}")
    for name, (device, main) in times.items():
        print(f"{name:<52} {median(device):14.1f} {median(main):12.1f}")


def gluon_host_costs(head_dims=(64, 128, 256), seqlen=1024, queued=20, repeats=5):
    """Host microseconds per call of the Gluon Hopper paths at the protocol's short causal cells (bf16, B*N = 16k,
    H = 2048 / d): ``queued`` calls enqueued with no wait, best of ``repeats`` such batches (the GPU, slower than the
    host here, keeps the host from waiting): the Triton backend's forward and backward alone, mhattn.attention's forward
    with q, k, v requiring grad, torch's SDPA's the same, beside the Triton forward's GPU time. A cell whose host time
    per call exceeds its GPU time runs at the host's pace."""
    import time

    from mhattn.benchmark import timing

    triton = mhattn.registry.get_backend("triton")
    print(f"{'host us per call, enqueued, bf16, causal, N=' + str(seqlen):<44} {'d=' + '  d='.join(map(str, head_dims))}")
    rows = {}
    for head_dim in head_dims:
        batch, heads = 16384 // seqlen, 2048 // head_dim
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                                     generator=gen) for _ in range(4))
        params = AttentionParams(scale=head_dim ** -0.5, window_right=0)
        out, lse = triton.forward(q, k, v, params)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        calls = {
            "triton backend forward (Gluon)": lambda: triton.forward(q, k, v, params),
            "triton backend backward (Gluon)": lambda: triton.backward(dout, q, k, v, out, lse, params),
            "mhattn.attention forward, grad, triton": lambda: mhattn.attention(*leaves, is_causal=True,
                                                                                backend="triton"),
            "sdpa forward, grad": lambda: torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True),
        }
        for label, fn in calls.items():
            fn()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(queued):
                    fn()
                best = min(best, (time.perf_counter() - start) / queued * 1e6)
                torch.cuda.synchronize()
            rows.setdefault(label, []).append(best)
        gpu_ms = timing.bench_ms(calls["triton backend forward (Gluon)"], 25.0, 100.0, "cuda")
        rows.setdefault("triton backend forward, GPU us", []).append(gpu_ms * 1e3)
    for label, values in rows.items():
        print(f"{label:<44} " + "  ".join(f"{value:6.1f}" for value in values))


def torch_kernel_rows(shape, grad: bool) -> dict:
    """{label: call} at ``shape`` (B, H, N, D), bf16: torch's public SDPA, each fused kernel through its private op's
    binding (``torch._scaled_dot_product_<kernel>_attention``, what the public op runs after its choice; with
    ``grad`` each call's output is differentiated), the public op pinned to flash, and mhattn on auto. Each is
    checked against the public op first."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    dout = torch.randn_like(q)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def pinned_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k, v)

    outputs = {
        "torch sdpa": lambda: sdpa(q, k, v),
        "torch flash op binding": lambda: torch._scaled_dot_product_flash_attention(q, k, v)[0],
        "torch cuDNN op binding": lambda: torch._scaled_dot_product_cudnn_attention(q, k, v, None, grad)[0],
        "torch efficient op binding": lambda: torch._scaled_dot_product_efficient_attention(q, k, v, None, grad)[0],
        "torch sdpa pinned to flash": pinned_flash,
        "mhattn auto": lambda: mhattn.attention(q, k, v),
    }
    expected = outputs["torch sdpa"]().float()
    for label, fn in outputs.items():
        error = (fn().float() - expected).abs().max().item()
        if error > 2e-2:
            raise AssertionError(f"{label}: max error {error} against torch's sdpa")
    if not grad:
        return outputs
    return {label: (lambda fn=fn: fn().backward(dout)) for label, fn in outputs.items()}


def torch_kernels():
    """torch_kernel_rows at each bf16 latency shape, forward and forward+backward, the calls of a shape and mode in
    turns (seven rounds, the best of each); prints each call's host loop and its ratio to the public op's."""
    print(f"{'shape':<22} {'mode':<8} {'call':<28} {'us':>8} {'x sdpa':>7}")
    for _, dims in bf16_latency_shapes():
        for grad in (False, True):
            calls = torch_kernel_rows(dims, grad)
            for fn in calls.values():
                for _ in range(20):
                    fn()
            best, errors = latency.host_loops_in_turn(calls, 300, "cuda", 7)
            for label, error in errors.items():
                print(f"{label}: {type(error).__name__}: {str(error)[:120]}")
            for label, us in best.items():
                print(f"{str(dims):<22} {'fwd+bwd' if grad else 'fwd':<8} {label:<28} {us:8.1f} "
                      f"{us / best['torch sdpa']:7.2f}", flush=True)


def relay_functions(backend, params):
    """A forward+backward of ``backend`` as two autograd nodes, so that its backward runs on the calling thread:
    ``Work`` runs the forward and the backward and outputs only an empty CPU tensor; ``Relay`` outputs (out, lse)
    and its backward hands their gradient to Work's node and returns none. The engine runs a node whose incoming
    gradients are all CPU or undefined on the calling thread, and others on the device's thread, so Relay (a few
    Python lines) runs on the device thread and Work's backward on the calling thread, at the cost of two more
    hand-offs between the threads. Returns ``call(q, k, v) -> out``, whose ``threads`` lists the thread each of
    Work's backwards ran on. (Work's node keeps out and lse detached, so no reference cycle runs through Relay's
    outputs.)"""
    import threading

    threads = []

    class Work(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.grad_out, ctx.outputs = None, _saved_forward(ctx, backend, params, q, k, v)
            return torch.empty(0)

        @staticmethod
        def backward(ctx, _undefined):
            threads.append(threading.get_ident())
            q, k, v, out, lse = ctx.saved_tensors
            grad_out, ctx.grad_out = ctx.grad_out, None
            return backend.backward(grad_out, q, k, v, out, lse, params)[:3]

    class Relay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, token):
            work = ctx.work = token.grad_fn
            ctx.set_materialize_grads(False)
            out, lse = (t.detach() for t in work.outputs)
            work.outputs = None
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            ctx.work.grad_out = grad_out
            return None

    def call(q, k, v):
        return Relay.apply(Work.apply(q, k, v))[0]

    call.threads = threads
    return call


def relay():
    """At the three bf16 latency shapes: forward+backward host loops of torch's SDPA, and of the Triton and CuPy
    backends through one autograd Function (_two_output_function), through the relay (relay_functions) and through
    mhattn.attention, in turns; the relay's gradients checked against the one-node Function's first, and the thread
    each backward ran on reported."""
    import threading

    main_thread = threading.get_ident()
    print(f"{'shape':<22} {'call':<34} {'us':>8} {'x sdpa':>7}")
    for shape, dims in bf16_latency_shapes():
        q, k, v = (torch.randn(*dims, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        params = AttentionParams(scale=shape.head_dim ** -0.5)
        calls = {"torch sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(dout)}
        for name in ("triton", "cupy"):
            backend = mhattn.registry.get_backend(name)
            if backend.unavailable():
                continue
            relayed, one_node = relay_functions(backend, params), _two_output_function(backend, params)
            expected = torch.autograd.grad(one_node.apply(q, k, v)[0], (q, k, v), dout)
            got = torch.autograd.grad(relayed(q, k, v), (q, k, v), dout)
            for a, b in zip(expected, got):
                torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)  # (the CuPy backward adds dQ in any order)
            print(f"{name}: the relay's backward ran on the calling thread: {relayed.threads[-1] == main_thread}")
            calls[f"{name} one node"] = lambda f=one_node: f.apply(q, k, v)[0].backward(dout)
            calls[f"{name} relay"] = lambda f=relayed: f(q, k, v).backward(dout)
            calls[f"mhattn.attention {name}"] = lambda name=name: mhattn.attention(q, k, v, backend=name).backward(dout)
        for fn in calls.values():
            for _ in range(20):
                fn()
        best, _ = latency.host_loops_in_turn(calls, 300, "cuda", 5)
        for label, us in best.items():
            print(f"{str(dims):<22} {label:<34} {us:8.1f} {us / best['torch sdpa']:7.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=("triton-fwd", "triton-bwd", "cupy-fwd"), default=None)
    parser.add_argument("--paths", action="store_true",
                        help="only the call paths of auto beside torch's SDPA at the latency shapes (call_paths)")
    parser.add_argument("--single-thread", action="store_true",
                        help="also the rows with a backward with autograd's multithreading off")
    parser.add_argument("--bisect", action="store_true",
                        help="only the Triton forward+backward through four wrappers (bisect_rows), both threading "
                             "modes")
    parser.add_argument("--device-thread", action="store_true",
                        help="also time pieces of host work on autograd's device thread and the main thread")
    parser.add_argument("--gluon", action="store_true",
                        help="only the host cost per call of the Gluon Hopper paths at the protocol's short causal "
                             "cells (gluon_host_costs)")
    parser.add_argument("--torch-kernels", action="store_true",
                        help="only torch's fused kernels through their private ops' bindings beside the public op "
                             "and mhattn on auto, at the latency shapes (torch_kernels)")
    parser.add_argument("--relay", action="store_true",
                        help="only the Triton and CuPy backward on the calling thread through a two-node relay, "
                             "beside one node (relay)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_profile.py needs a CUDA GPU (benchmarks/host_cost.py is the CPU counterpart)")
    if args.gluon:
        gluon_host_costs()
        return
    if args.paths:
        call_paths()
        return
    if args.torch_kernels or args.relay:
        if args.torch_kernels:
            torch_kernels()
        if args.relay:
            relay()
        return
    if args.bisect:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        wrappers = bisect_rows(*(t.requires_grad_() for t in (q, k, v)), dout)
        title = "forward+backward host loop, us (B=1 H=16 N=128 d=64 bf16)"
        print(f"{title:<52} {'device thread':>14} {'1 thread':>9}")
        for label, fn in wrappers + wrappers:  # twice: the host drifts
            multi = host_loop_us(fn)
            with torch.autograd.set_multithreading_enabled(False):
                single = host_loop_us(fn)
            print(f"{label:<52} {multi:14.1f} {single:9.1f}", flush=True)
        return
    table, tensors = rows()
    results = [(label, host_loop_us(fn)) for label, fn in table]
    if args.single_thread:
        with torch.autograd.set_multithreading_enabled(False):
            results += [(f"{label} [1 thread]", host_loop_us(fn)) for label, fn in table if "backward" in label]
    if args.profile in ("triton-fwd", "cupy-fwd"):
        profile_forward(*tensors[:3], backend=args.profile.split("-")[0])
    if args.profile == "triton-bwd":
        profile_triton_backward(*tensors)
    if args.device_thread:
        device_thread_pieces(*tensors)
    print(f"{'host loop per call, B=1 H=16 N=128 d=64 bf16':<52} {'us':>8}")
    for label, us in results:
        print(f"{label:<52} {us:8.1f}")


if __name__ == "__main__":
    main()
