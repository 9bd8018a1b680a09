"""The compiled-handle launcher (backends/triton/launcher.py): a kept handle is reused exactly where Triton would
pick the same compiled kernel, and never elsewhere. CPU only: Triton's own launch is replaced by a recorder."""

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402

from mhattn.backends.triton import launcher as launcher_module  # noqa: E402
from mhattn.backends.triton.launcher import CompiledLauncher  # noqa: E402


def small_kernel(X, Y, stride_x, rows, scale, flag, BLOCK: "tl.constexpr", EVEN: "tl.constexpr" = False):  # noqa: F821
    pass


def misordered_kernel(X, BLOCK: "tl.constexpr", rows):  # noqa: F821
    pass


class _Compiled:
    def __init__(self, log, number):
        self.log, self.number = log, number
        self.function, self.packed_metadata = f"function{number}", f"metadata{number}"

    def run(self, *args):
        self.log.append(("handle", self.number, args))


class RecordingKernel:
    """A real JITFunction's parameter list; ``kernel[grid](...)`` records the launch and returns a new handle."""

    def __init__(self, fn, **jit_options):
        self.jit = JITFunction(fn, **jit_options)
        self.params = self.jit.params
        self.__name__ = fn.__name__
        self.log, self.compiled = [], 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiled += 1
            self.log.append(("triton", self.compiled, grid, args, kwargs))
            return _Compiled(self.log, self.compiled)

        return launch


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setattr(launcher_module, "current_stream", lambda index: 1234)
    monkeypatch.setattr(launcher_module, "_launch_hooks_set", lambda: False)
    kernel = RecordingKernel(small_kernel, do_not_specialize=["rows"])
    return kernel, CompiledLauncher(kernel)


def buffers(offset=0):
    x = torch.zeros(64, dtype=torch.float16)[offset:offset + 32]
    return x, torch.zeros(32, dtype=torch.float32)


def launch(launcher, x, y, stride=16, rows=100, scale=0.5, flag=True, **constexprs):
    sets = launcher.constexprs(4, 2, BLOCK=constexprs.pop("BLOCK", 64), **constexprs)
    launcher.launch((3, 2), (x, y, stride, rows, scale, flag), sets, device_index=0)


def kinds(kernel):
    return [entry[0] for entry in kernel.log]


def test_the_second_launch_goes_to_the_kept_handle_with_every_argument_in_order(recording):
    kernel, launcher = recording
    x, y = buffers()
    launch(launcher, x, y)
    launch(launcher, x, y, rows=7, scale=2.0)
    assert kinds(kernel) == ["triton", "handle"]
    _, number, args = kernel.log[1]
    assert number == 1
    # grid (3, 2, 1), the stream, the handle's function and metadata, no launch metadata or hooks,
    # then the runtime arguments and the compile-time values in parameter order (EVEN's default included).
    assert args[:9] == (3, 2, 1, 1234, "function1", "metadata1", None, None, None)
    # Tensors reach the handle as their addresses (Triton's launcher then asks the driver nothing).
    assert args[9:] == (x.data_ptr(), y.data_ptr(), 16, 7, 2.0, True, 64, False)
    assert all(type(a) is int for a in args[9:11])
    assert kernel.log[0][3] == (x, y, 16, 100, 0.5, True)
    # Fused multiply-adds asked for whatever Triton's default (launcher.COMPILE_OPTIONS).
    assert kernel.log[0][4] == {"BLOCK": 64, "num_warps": 4, "num_stages": 2, "enable_fp_fusion": True}
    assert launcher.handle_launches == 1


@pytest.mark.parametrize("change", [
    "misaligned tensor", "tensor dtype", "specialised int divisibility", "specialised int one",
    "int64 plain int", "constexpr", "default constexpr", "argument type", "num_warps", "device", "compile option",
])
def test_anything_triton_specialises_on_takes_triton_s_path_again(recording, change):
    kernel, launcher = recording
    x, y = buffers()
    launch(launcher, x, y)
    if change == "misaligned tensor":
        launch(launcher, buffers(offset=1)[0], y)
    elif change == "tensor dtype":
        launch(launcher, x, y.double())
    elif change == "specialised int divisibility":
        launch(launcher, x, y, stride=17)
    elif change == "specialised int one":
        launch(launcher, x, y, stride=1)
    elif change == "int64 plain int":
        launch(launcher, x, y, rows=2**31)
    elif change == "constexpr":
        launch(launcher, x, y, BLOCK=32)
    elif change == "default constexpr":
        launch(launcher, x, y, EVEN=True)
    elif change == "argument type":
        launch(launcher, x, y, scale=1)  # an int where a float was: i32, not fp32
    elif change == "num_warps":
        launcher.launch((3,), (x, y, 16, 100, 0.5, True), launcher.constexprs(8, 2, BLOCK=64), device_index=0)
    elif change == "device":
        launcher.launch((3,), (x, y, 16, 100, 0.5, True), launcher.constexprs(4, 2, BLOCK=64), device_index=1)
    elif change == "compile option":  # e.g. a programmatic dependent launch: Triton compiles a kernel that asks for it
        sets = launcher.constexprs(4, 2, {"launch_pdl": True}, BLOCK=64)
        launcher.launch((3, 2), (x, y, 16, 100, 0.5, True), sets, device_index=0)
        assert kernel.log[-1][4] == {"BLOCK": 64, "num_warps": 4, "num_stages": 2, "enable_fp_fusion": True,
                                     "launch_pdl": True}
    assert kinds(kernel) == ["triton", "triton"]


def map_kernel(Xmap, Y, rows, BLOCK: "tl.constexpr"):  # noqa: F821
    pass


@pytest.mark.parametrize("change", ["none", "dtype", "block shape", "layout"])
def test_host_tensor_maps_key_the_handle_by_dtype_block_and_layout(monkeypatch, change):
    """A host tensor map (Gluon TensorDescriptor) is typed by Triton from its dtype, block shape and layout only:
    a new map of a new tensor with the same three keeps the handle; any of them changed goes through Triton."""
    gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from mhattn.backends.triton.hopper_forward import tile_layout

    monkeypatch.setattr(launcher_module, "current_stream", lambda index: 1234)
    monkeypatch.setattr(launcher_module, "_launch_hooks_set", lambda: False)
    kernel = RecordingKernel(map_kernel)
    launcher = CompiledLauncher(kernel)

    def tensor_map(dtype=torch.float16, block=(64, 64), swizzle=None):
        x = torch.zeros(128, 64, dtype=dtype)
        bits = x.element_size() * 8
        layout = tile_layout(block[0], block[1], bits) if swizzle is None else \
            type(tile_layout(64, 64, 16))(swizzle_byte_width=swizzle, element_bitwidth=bits, rank=2)
        return gluon_hopper.TensorDescriptor(x, list(x.shape), list(x.stride()), list(block), layout)

    sets = launcher.constexprs(4, 1, BLOCK=64)
    y = torch.zeros(8)
    launcher.launch((1,), (tensor_map(), y, 5), sets, device_index=0)
    second = {"none": tensor_map(), "dtype": tensor_map(dtype=torch.bfloat16), "block shape": tensor_map(block=(32, 64)),
              "layout": tensor_map(swizzle=64)}[change]
    launcher.launch((1,), (second, y, 5), sets, device_index=0)
    assert kinds(kernel) == ["triton", "handle" if change == "none" else "triton"]
    if change == "none":
        assert kernel.log[1][2][9] is second  # the new map itself reaches the handle
        with pytest.raises(TypeError, match="tensor maps"):
            launcher.prepare((1,), (second, y, 5), sets, 0)


def test_a_plain_int_s_value_and_a_new_address_keep_the_handle(recording):
    kernel, launcher = recording
    x, y = buffers()
    launch(launcher, x, y, rows=100)
    x2, y2 = buffers()
    launch(launcher, x2, y2, rows=12345)
    assert kinds(kernel) == ["triton", "handle"]


def test_launch_hooks_leave_every_launch_to_triton(recording, monkeypatch):
    kernel, launcher = recording
    x, y = buffers()
    launch(launcher, x, y)
    monkeypatch.setattr(launcher_module, "_launch_hooks_set", lambda: True)
    launch(launcher, x, y)
    assert kinds(kernel) == ["triton", "triton"]


def test_bad_compile_time_arguments_are_named(recording):
    _, launcher = recording
    with pytest.raises(TypeError, match="not compile-time parameters: \\['BLOKC'\\]"):
        launcher.constexprs(4, 2, BLOKC=64)
    with pytest.raises(TypeError, match="without a value: \\['BLOCK'\\]"):
        launcher.constexprs(4, 2)
    x, y = buffers()
    with pytest.raises(TypeError, match="expected 6 runtime arguments, got 5"):
        launcher.launch((1,), (x, y, 16, 100, 0.5), launcher.constexprs(4, 2, BLOCK=64), device_index=0)


def test_kernels_whose_compile_time_parameters_come_first_are_refused():
    with pytest.raises(TypeError, match="must follow every runtime parameter"):
        CompiledLauncher(RecordingKernel(misordered_kernel))


def test_the_attention_kernels_fit_the_launcher():
    """Every dense kernel of the Triton backend has its compile-time parameters last (what the launcher needs)."""
    import importlib

    for module, names in (("forward", ["attention_forward_kernel"]),
                          ("backward", ["backward_preprocess_kernel", "backward_dkdv_kernel", "backward_dq_kernel"]),
                          ("decode", ["split_kv_kernel", "combine_splits_kernel", "append_kv_kernel"])):
        mod = importlib.import_module(f"mhattn.backends.triton.{module}")
        for name in names:
            kernel = getattr(mod, name)
            fn = getattr(kernel, "fn", kernel)
            launcher = CompiledLauncher(RecordingKernel(fn))
            assert launcher.num_runtime >= 10 and launcher.constexpr_names, name


def test_a_prepared_launch_keeps_the_handle_for_new_tensors_and_passes_every_argument(recording):
    kernel, launcher = recording
    x, y = buffers()
    prepared = launcher.prepare((3, 2), (x, y, 16, 100, 0.5, True), launcher.constexprs(4, 2, BLOCK=64), 0)
    prepared.launch((x, y, 16, 100, 0.5, True))
    x2, y2 = buffers()
    prepared.launch((x2, y2, 16, 100, 0.5, True))
    assert kinds(kernel) == ["triton", "handle"]
    assert kernel.log[1][2] == (3, 2, 1, 1234, "function1", "metadata1", None, None, None,
                                x2.data_ptr(), y2.data_ptr(), 16, 100, 0.5, True, 64, False)
    prepared.launch((buffers(offset=1)[0], y, 16, 100, 0.5, True))  # another alignment: Triton's path
    prepared.launch((x, y.double(), 16, 100, 0.5, True))  # another dtype: Triton's path
    assert kinds(kernel) == ["triton", "handle", "triton", "triton"]
    with pytest.raises(TypeError, match="expected 6 runtime arguments, got 5"):
        launcher.prepare((1,), (x, y, 16, 100, 0.5), launcher.constexprs(4, 2, BLOCK=64), 0)


def test_prepared_launches_of_other_sites_never_share_a_handle(recording):
    kernel, launcher = recording
    x, y = buffers()
    for stride in (16, 17):
        launcher.prepare((3,), (x, y, stride, 100, 0.5, True), launcher.constexprs(4, 2, BLOCK=64), 0).launch(
            (x, y, stride, 100, 0.5, True))
    assert kinds(kernel) == ["triton", "triton"]


def test_a_prepared_launch_leaves_hooked_launches_to_triton(recording, monkeypatch):
    kernel, launcher = recording
    x, y = buffers()
    prepared = launcher.prepare((3,), (x, y, 16, 100, 0.5, True), launcher.constexprs(4, 2, BLOCK=64), 0)
    prepared.launch((x, y, 16, 100, 0.5, True))
    monkeypatch.setattr(launcher_module, "_launch_hooks_set", lambda: True)
    prepared.launch((x, y, 16, 100, 0.5, True))
    assert kinds(kernel) == ["triton", "triton"]


class _Address(int):
    """A tensor's address that remembers the tensor (what the launcher passes a kept handle, under
    :func:`_recording_backend_launchers`), so a recorded launch can show what it was the address of."""

    def __new__(cls, tensor):
        address = super().__new__(cls, torch.Tensor.data_ptr(tensor))
        address.tensor = tensor
        return address


def _recorded_launch(entry, launcher):
    """A recorded launch as (grid, runtime arguments, compile-time values), tensors (and the addresses of tensors
    passed to a kept handle) as (shape, strides, dtype)."""
    if entry[0] == "triton":
        _, _, grid, args, kwargs = entry
        grid = tuple(grid) + (1,) * (3 - len(grid))
        constexprs = tuple(kwargs.get(n, launcher.constexpr_defaults[n]) for n in launcher.constexpr_names)
    else:
        args = entry[2]
        grid, constexprs = args[:3], args[9 + launcher.num_runtime:]
        args = args[9:9 + launcher.num_runtime]
    args = tuple(a.tensor if isinstance(a, _Address) else a for a in args)
    args = tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
    return grid, args, constexprs


def _recording_backend_launchers(monkeypatch, interpret: bool):
    """The Triton backend's launchers over recording kernels (every kernel it launches), installed; the
    backend's INTERPRET flag set to ``interpret`` (True lets CPU tensors reach the launches). Returns (the
    recorders by kernel name, the launchers)."""
    from types import SimpleNamespace

    from mhattn.backends.triton import backend as tb
    from mhattn.backends.triton import backward, decode, forward

    monkeypatch.setattr(launcher_module, "current_stream", lambda index: 1234)
    monkeypatch.setattr(launcher_module, "_launch_hooks_set", lambda: False)
    monkeypatch.setattr(launcher_module, "_DATA_PTR", _Address)
    jit = {name: RecordingKernel(getattr(module, name).fn) for module, name in (
        (forward, "attention_forward_kernel"), (backward, "backward_preprocess_kernel"),
        (backward, "backward_dkdv_kernel"), (backward, "backward_dq_kernel"), (backward, "backward_short_kernel"),
        (decode, "split_kv_kernel"),
        (decode, "combine_splits_kernel"), (decode, "append_kv_kernel"))}
    launchers = tb._Launchers(SimpleNamespace(**jit), SimpleNamespace(**jit), SimpleNamespace(**jit))
    for launcher in vars(launchers).values():
        launcher.interpret = False
    monkeypatch.setattr(tb, "launchers", lambda: launchers)
    monkeypatch.setattr(tb, "INTERPRET", interpret)
    return jit, launchers


def test_the_backend_s_prepared_launches_pass_what_a_first_call_passes(monkeypatch):
    """Calls of many signatures, each run twice: the second (through the launches prepared at the first, with
    every other signature's in between) passes the kernels what the first passed."""
    import mhattn
    from mhattn.backends.triton import backend as tb

    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=False)
    backend = tb.TritonBackend(deterministic=True)

    qkv = torch.randn(2, 40, 3, 4, 16)
    packed = [qkv[:, :, i].transpose(1, 2) for i in range(3)]  # strided views
    q, k, v = (torch.randn(2, 4, 40, 16) for _ in range(3))
    k2, v2 = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 24)
    padding = (torch.arange(40) < 30).expand(2, 4, 40, 40)
    float_mask = torch.randn(2, 1, 40, 40).expand(2, 4, 40, 40)
    seed = torch.tensor([3, 4], dtype=torch.int64)
    cases = [
        ((q, k, v), AttentionParamsArgs(scale=0.25)),
        ((q, k, v), AttentionParamsArgs(scale=0.5, window_right=0)),
        ((q, k, v), AttentionParamsArgs(scale=0.5, window_left=7, window_right=3, diag_offset=2)),
        ((q, k, v), AttentionParamsArgs(scale=0.5, softcap=20.0)),
        ((q, k, v), AttentionParamsArgs(scale=0.5, dropout_p=0.2, seed=seed)),
        ((q, k, v), AttentionParamsArgs(scale=0.5, mask=padding)),
        ((q, k, v), AttentionParamsArgs(scale=0.5, mask=float_mask, mask_requires_grad=True)),
        ((q, k2, v2), AttentionParamsArgs(scale=0.5, window_right=0)),
        (tuple(packed), AttentionParamsArgs(scale=0.25)),
    ]

    def run_case(inputs, params, grad_lse_case, grad_out_layout, fresh=False):
        if fresh:  # no signature, so no prepared launch: everything worked out anew
            tb._signatures.clear()
        before = {name: len(kernel.log) for name, kernel in jit.items()}
        out, lse = backend.forward(*inputs, params)
        grad_out = torch.randn(2, 40, out.shape[1], out.shape[3])
        grad_out = grad_out.transpose(1, 2) if grad_out_layout else grad_out.permute(0, 2, 1, 3).contiguous()
        grad_lse = torch.randn_like(lse) if grad_lse_case else None
        backend.backward(grad_out, *inputs, out, lse, params, grad_lse=grad_lse)
        return {name: [_recorded_launch(entry, launchers_by_kernel[name]) for entry in kernel.log[before[name]:]]
                for name, kernel in jit.items()}

    launchers_by_kernel = {launcher.kernel.__name__: launcher for launcher in vars(launchers).values()}
    for i, (inputs, params) in enumerate(cases):  # prepares each signature's launches
        run_case(inputs, params, i % 2 == 0, True)
    # Again with the other grad_lse and grad_out layout, through the prepared launches, and from scratch.
    again = [run_case(inputs, params, i % 2 == 1, i % 3 != 0) for i, (inputs, params) in enumerate(cases)]
    fresh = [run_case(inputs, params, i % 2 == 1, i % 3 != 0, fresh=True) for i, (inputs, params) in enumerate(cases)]
    assert again == fresh
    # 40 keys fit the short backward's one block, except where the lse or the mask gets a gradient.
    assert all(call["attention_forward_kernel"] and (call["backward_dkdv_kernel"] or call["backward_short_kernel"])
               for call in again)
    assert any(call["backward_short_kernel"] for call in again) and any(call["backward_dkdv_kernel"] for call in again)
    assert any(call["backward_dq_kernel"] for call in again)


def AttentionParamsArgs(**kwargs):
    from mhattn.backends.base import AttentionParams

    return AttentionParams(**kwargs)


def test_the_decoding_launches_prepared_once_pass_what_a_first_call_passes(monkeypatch):
    """Split-KV decoding (dense, contiguous cache, paged caches with three block tables), the KV cache's append
    (contiguous, paged, a strided cache_seqlens), the step that appends inside the split kernel (the same, and a
    transposed block table) and the steps prepared per call signature (kvcache_call, with and without an append and
    an lse): each call run again goes through the launches prepared at its first run (with the others in between)
    and passes the kernels what a call worked out from scratch passes."""
    from mhattn.backends.base import KVCache
    from mhattn.backends.triton import backend as tb
    from mhattn.backends.triton import decode_launch

    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=True)  # CPU tensors reach the launches
    monkeypatch.setattr(decode_launch, "_sm_count", lambda index: 132)
    monkeypatch.setattr(decode_launch, "_append_sites", {})  # none prepared by another test's launchers
    backend = tb.TritonBackend()

    q = torch.randn(2, 8, 1, 16)
    k, v = torch.randn(2, 2, 3000, 16), torch.randn(2, 2, 3000, 16)
    pool_k, pool_v = torch.randn(40, 2, 64, 16), torch.randn(40, 2, 64, 16)
    seqlens = torch.tensor([1000, 2500], dtype=torch.int32)
    # Two block tables of one capacity with other row strides, and one of twice the capacity.
    tables = [torch.arange(40, dtype=torch.int32).view(2, 20), (torch.arange(80, dtype=torch.int32) % 40).view(2, 40)[:, 20:]]
    wide_table = torch.arange(80, dtype=torch.int32).view(2, 40) % 40
    new_k, new_v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    strided_seqlens = torch.tensor([1000, 0, 2500, 0], dtype=torch.int32)[::2]
    params = AttentionParamsArgs(scale=0.25, diag_offset=2999, window_right=0)
    calls = [
        lambda: backend.forward(q, k, v, params),
        lambda: backend.forward_kvcache(q, KVCache(k, v, seqlens), params),
        lambda: backend.forward_kvcache(q, KVCache(pool_k, pool_v, seqlens, tables[0]), params),
        lambda: backend.forward_kvcache(q, KVCache(pool_k, pool_v, seqlens, tables[1]), params),
        lambda: backend.forward_kvcache(q, KVCache(pool_k, pool_v, seqlens, wide_table), params),  # more capacity
        lambda: backend.append_kvcache(k, v, new_k, new_v, seqlens, None),
        lambda: backend.append_kvcache(pool_k, pool_v, new_k, new_v, seqlens, tables[0]),
        lambda: backend.append_kvcache(pool_k, pool_v, new_k, new_v, seqlens, tables[1]),
        lambda: backend.append_kvcache(k, v, new_k, new_v, strided_seqlens, None),
        lambda: backend.forward_kvcache_appending(q, k, v, new_k, new_v, seqlens, None, params),
        lambda: backend.forward_kvcache_appending(q, pool_k, pool_v, new_k, new_v, seqlens, tables[1], params),
        lambda: backend.forward_kvcache_appending(q, pool_k, pool_v, new_k, new_v, strided_seqlens, wide_table.t()
                                                  .contiguous().t(), params),
    ]
    prepared = {}  # kvcache_call's steps, made at a call's first run (again from scratch when fresh)

    def prepared_step(number, *args, return_lse):
        if number not in prepared:
            prepared[number] = backend.kvcache_call(*args, params, return_lse)
        return prepared[number](*args)

    calls += [
        lambda: prepared_step(0, q, k, v, new_k, new_v, seqlens, None, return_lse=True),
        lambda: prepared_step(1, q, pool_k, pool_v, None, None, strided_seqlens, tables[0], return_lse=False),
        lambda: prepared_step(2, q, pool_k, pool_v, new_k, new_v, seqlens, tables[1], return_lse=False),
    ]
    launchers_by_kernel = {launcher.kernel.__name__: launcher for launcher in vars(launchers).values()}

    def run_call(call, fresh=False):
        if fresh:
            tb._signatures.clear()
            decode_launch._append_sites.clear()
            prepared.clear()
        before = {name: len(kernel.log) for name, kernel in jit.items()}
        call()
        return {name: [_recorded_launch(entry, launchers_by_kernel[name]) for entry in kernel.log[before[name]:]]
                for name, kernel in jit.items()}

    first = [run_call(call) for call in calls]
    again = [run_call(call) for call in calls]
    fresh = [run_call(call, fresh=True) for call in calls]
    assert again == fresh == first
    assert all(call["split_kv_kernel"] for call in again[:5]) and any(call["combine_splits_kernel"] for call in again)
    assert all(call["append_kv_kernel"] for call in again[5:9])
    assert all(call["split_kv_kernel"] and not call["append_kv_kernel"] for call in again[9:])
    assert any(entry[0] == "handle" for entry in jit["split_kv_kernel"].log)  # the repeats went through handles
    assert any(entry[0] == "handle" for entry in jit["append_kv_kernel"].log)


# ---- launches with host tensor maps of a fixed geometry (launcher.PreparedMapLaunch) ------------------------------

# The names the direct path reads from a compiled launcher's globals, as Triton 3.6's driver module has them: the map
# encoder and the length of the launch arguments' head. These stand-ins encode a map as a tuple saying what it maps.
_BASE_ARGS_FORMAT_LEN = 13
ENCODED = []


def make_tensordesc_arg(descriptor, meta):
    ENCODED.append(descriptor.base.data_ptr())
    return [("encoded", descriptor.base.data_ptr(), tuple(descriptor.block_shape), meta["swizzle"]),
            *descriptor.shape, *descriptor.strides]


def _launch_laid_out_as_triton_3_6(c_launch, tensordesc_indices, tensordesc_meta):
    """A compiled launcher's ``launch`` with Triton 3.6's layout: the 13 head items, then each kernel argument, a map
    expanded by the module's encoder with its metadata, handed to the C launch function (here a recorder)."""
    launcher = c_launch

    def inner(*args):
        expanded, maps = list(args[:_BASE_ARGS_FORMAT_LEN]), 0
        for index, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if index in tensordesc_indices:
                expanded.extend(make_tensordesc_arg(arg, tensordesc_meta[maps]))
                maps += 1
            else:
                expanded.append(arg)
        return launcher(*expanded)

    return inner


class _Triton36Run:
    """A compiled kernel's launcher called as Triton 3.6's is: (grid, stream, function, *args) in, the C launch
    function out with the launch flags and (absent) scratch memory after the function."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, log, launch=None):
        self.launch = launch or _launch_laid_out_as_triton_3_6(lambda *args: log.append(("c", args)), {0}, [
            {"swizzle": 3, "elem_size": 2, "elem_type": 1, "block_size": [64, 64], "fp4_padded": False}])

    def __call__(self, grid_x, grid_y, grid_z, stream, function, *args):
        self.launch(grid_x, grid_y, grid_z, stream, function, self.launch_cooperative_grid, self.launch_pdl, None,
                    None, *args)


class _Compiled36(_Compiled):
    def __init__(self, log, number, launch=None):
        super().__init__(log, number)
        self.run = _Triton36Run(log, launch)


class Recording36Kernel(RecordingKernel):
    """A RecordingKernel whose compiled kernels' launchers are laid out as Triton 3.6's (``launch``: the factory of
    their C-launch wrapper, default the stand-in above)."""

    def __init__(self, fn, launch=None):
        super().__init__(fn)
        self.launch = launch

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiled += 1
            self.log.append(("triton", self.compiled, grid, args, kwargs))
            return _Compiled36(self.log, self.compiled, self.launch and self.launch(self.log))

        return launch


def _fp16_map(tensor, block=(64, 64)):
    gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from mhattn.backends.triton.hopper_forward import tile_layout

    return gluon_hopper.TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), list(block),
                                         tile_layout(block[0], block[1], 16))


@pytest.fixture
def map_recording(monkeypatch):
    monkeypatch.setattr(launcher_module, "current_stream", lambda index: 1234)
    monkeypatch.setattr(launcher_module, "_launch_hooks_set", lambda: False)
    ENCODED.clear()
    return Recording36Kernel(map_kernel)


def _expected_c_launch(kernel, number, descriptor, y, rows):
    """What Triton 3.6's own launcher passes its C launch function for these arguments through the kept handle."""
    compiled = _Compiled36([], number)
    log = []
    compiled.run = _Triton36Run(log)
    compiled.run(3, 1, 1, 1234, compiled.function, compiled.packed_metadata, None, None, None, descriptor,
                 y.data_ptr(), rows, 64)
    return log[0][1]


def test_a_prepared_map_launch_passes_the_c_launch_what_triton_s_wrapper_would(map_recording):
    """After the first launch (Triton's path), launches with new tensors call the C launch function directly with
    the very arguments Triton 3.6's wrapper would pass it, each map encoded once per address; another alignment of a
    pointer argument, a map's tensor of another dtype, and launch hooks take Triton's path."""
    kernel = map_recording
    launcher = CompiledLauncher(kernel)
    sets = launcher.constexprs(4, 1, BLOCK=64)
    x1, y1 = torch.zeros(128, 64, dtype=torch.float16), torch.zeros(8)
    site = launcher.prepare_maps((3,), (_fp16_map(x1), y1, 5), sets, 0)
    site.launch((x1, y1, 5))
    assert kinds(kernel) == ["triton"] and kernel.log[0][3][0].base is x1
    for _ in range(2):
        x2, y2 = torch.zeros(128, 64, dtype=torch.float16), torch.zeros(8)
        encoded_before = len(ENCODED)
        site.launch((x2, y2, 5))
        site.launch((x2, y2, 5))
        assert ENCODED[encoded_before:] == [x2.data_ptr()]  # one encoding for two launches over x2
        assert kernel.log[-1] == ("c", _expected_c_launch(kernel, 1, _fp16_map(x2), y2, 5))
        assert kernel.log[-2] == kernel.log[-1]
    assert launcher.handle_launches == 4
    site.launch((x2, torch.zeros(9)[1:], 5))  # Y 4 bytes past a 16-byte boundary: another specialisation
    assert kinds(kernel)[-1] == "triton"
    site.launch((x2.bfloat16(), y2, 5))  # a bfloat16 tensor in a float16 map's place: never the float16 handle
    assert kinds(kernel)[-1] == "triton" and kernel.log[-1][3][0].base.dtype == torch.bfloat16


def test_a_prepared_map_launch_leaves_hooked_launches_to_triton(map_recording, monkeypatch):
    kernel = map_recording
    launcher = CompiledLauncher(kernel)
    x, y = torch.zeros(128, 64, dtype=torch.float16), torch.zeros(8)
    site = launcher.prepare_maps((3,), (_fp16_map(x), y, 5), launcher.constexprs(4, 1, BLOCK=64), 0)
    site.launch((x, y, 5))
    monkeypatch.setattr(launcher_module, "_launch_hooks_set", lambda: True)
    site.launch((x, y, 5))
    assert kinds(kernel) == ["triton", "triton"]


def test_a_prepared_map_launch_on_another_launcher_layout_goes_through_the_kept_handle(recording):
    """A compiled launcher not laid out as Triton 3.6's: the kept handle gets maps of the prepared geometry over the
    new tensors."""
    kernel = RecordingKernel(map_kernel)
    launcher = CompiledLauncher(kernel)
    x1, y = torch.zeros(128, 64, dtype=torch.float16), torch.zeros(8)
    prepared_map = _fp16_map(x1)
    site = launcher.prepare_maps((3,), (prepared_map, y, 5), launcher.constexprs(4, 1, BLOCK=64), 0)
    site.launch((x1, y, 5))
    x2 = torch.zeros(128, 64, dtype=torch.float16)
    site.launch((x2, y, 5))
    assert kinds(kernel) == ["triton", "handle"]
    passed = kernel.log[1][2][9]
    assert passed.base is x2 and passed.shape == prepared_map.shape and passed.strides == prepared_map.strides
    assert passed.block_shape == prepared_map.block_shape and passed.layout == prepared_map.layout
    with pytest.raises(TypeError, match="no host tensor maps"):
        launcher.prepare_maps((3,), (x1, y, 5), launcher.constexprs(4, 1, BLOCK=64), 0)


def test_a_prepared_map_launch_keeps_no_call_s_tensors_alive(map_recording):
    """A site keeps its maps' geometry, not the tensors of the call that prepared it or of later calls."""
    import gc
    import weakref

    kernel = map_recording
    launcher = CompiledLauncher(kernel)
    x, y = torch.zeros(128, 64, dtype=torch.float16), torch.zeros(8)
    site = launcher.prepare_maps((3,), (_fp16_map(x), y, 5), launcher.constexprs(4, 1, BLOCK=64), 0)
    site.launch((x, y, 5))
    x2 = torch.zeros(128, 64, dtype=torch.float16)
    site.launch((x2, y, 5))
    assert kinds(kernel) == ["triton", "c"]
    gone = [weakref.ref(x), weakref.ref(x2)]
    kernel.log.clear()
    del x, x2
    gc.collect()
    assert all(ref() is None for ref in gone)
    site.launch((torch.zeros(128, 64, dtype=torch.float16), y, 5))
    assert kinds(kernel) == ["c"]


def test_the_direct_path_reads_triton_3_6_s_own_launcher_wrapper(map_recording, monkeypatch):
    """Where Triton 3.6 is installed: its own wrapper (driver.wrap_handle_tensordesc) and encoder, over a recording C
    launch function and a stand-in for the driver's map encoding, are what the direct path finds and matches."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    if getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) != 13 or not hasattr(driver, "wrap_handle_tensordesc"):
        pytest.skip("Triton's launcher is not laid out as 3.6's here")
    from types import SimpleNamespace

    from triton.runtime.driver import driver as driver_config

    def fill_tma_descriptor(address, swizzle, elem_size, elem_type, block, shape, strides, padding):
        return ("encoded", address, tuple(block), swizzle)

    monkeypatch.setattr(driver_config, "_active", SimpleNamespace(
        utils=SimpleNamespace(fill_tma_descriptor=fill_tma_descriptor)))
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 1, "block_size": [64, 64], "fp4_padded": False}
    signature = {0: "tensordesc<fp16[64, 64]>", 1: "*fp32", 2: "i32", 3: "constexpr"}
    kernel = Recording36Kernel(map_kernel, launch=lambda log: driver.wrap_handle_tensordesc(
        lambda *args: log.append(("c", args)), signature, [meta]))
    launcher = CompiledLauncher(kernel)
    x1, x2, y = (torch.zeros(128, 64, dtype=torch.float16), torch.zeros(128, 64, dtype=torch.float16),
                 torch.zeros(8))
    site = launcher.prepare_maps((3,), (_fp16_map(x1), y, 5), launcher.constexprs(4, 1, BLOCK=64), 0)
    site.launch((x1, y, 5))
    site.launch((x2, y, 5))
    assert kinds(kernel) == ["triton", "c"]
    handle_log = []
    compiled = _Compiled36(handle_log, 1, driver.wrap_handle_tensordesc(
        lambda *args: handle_log.append(("c", args)), signature, [meta]))
    compiled.run(3, 1, 1, 1234, compiled.function, compiled.packed_metadata, None, None, None, _fp16_map(x2),
                 y.data_ptr(), 5, 64)
    assert kernel.log[-1] == handle_log[-1]
