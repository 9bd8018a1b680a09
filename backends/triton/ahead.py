"""Ahead-of-time compilation of the Triton kernels for a GPU target, with no GPU present.

``mhattn build --arch sm_90a`` compiles, through Triton's own compiler for an explicit target, every kernel
that the configuration table (configs.py) launches on that architecture: the forward, the dK/dV and the dQ
kernel of each (head dim, causal) entry, with their copy-engine (TMA) and dQ-mode switches, and the short backward
(one launch where every key fits one block) at each head dim's largest tile. CI runs a
sample of it so a kernel that no longer compiles for Hopper fails on a machine without a GPU. The
development harness (benchmarks/dev_triton.py) reads registers, shared memory and spills from the same
compiled objects.

Strides get the divisibility-16 hint that the JIT adds for aligned shapes, so what compiles here is what
the launches on the protocol's shapes compile.
"""

from __future__ import annotations

from dataclasses import dataclass

from mhattn.backends import ptxas_notes
from mhattn.backends.triton import configs, hopper_launch, scores
from mhattn.backends.triton.launcher import COMPILE_OPTIONS

# Kernel arguments that are pointers (float32 ones listed apart), floats; every other argument is an int32.
POINTERS = {"Q", "K", "V", "Out", "Lse", "Mask", "dOut", "Lse2", "Delta", "dK", "dV", "dQ", "dMask", "GradLse",
            "dQacc", "OutSplit", "LseSplit", "KCache", "VCache", "NewK", "NewV"}
# dK and dV are float32 partial sums in the Gluon backward's PARTIAL_DK_DV builds
PARTIAL_SUMS = {"dK", "dV"}
FP32_POINTERS = {"Lse", "Lse2", "Delta", "dMask", "GradLse", "dQacc", "OutSplit", "LseSplit"}
# int32 pointers: the dropout seed words read from the device (see forward.attention_forward_kernel); the
# cu_seqlens of packed sequences, key bounds of key padding masks (varlen_launch.py, key_padding.py), a KV
# cache's lengths before and after an append and its block table (decode.py), the Gluon forward's tile counter
# (hopper_launch), the Gluon backward's dQ counters and turn counters (hopper_backward.hopper_backward_kernel).
INT32_POINTERS = {"Seed", "CuSeqlensQ", "CuSeqlensK", "Seqlens", "CacheSeqlens", "BlockTable", "TileCounter",
                  "DqCounters", "KeyBounds", "DqTurns"}
FLOATS = {"qk_scale2", "softcap_in2", "softcap_out2", "dropout_scale", "sm_scale"}
KINDS = ("fwd", "dkdv", "dq", "short_bwd", "hopper_fwd", "hopper_bwd")
GLUON_KINDS = ("hopper_fwd", "hopper_bwd")
# "sm_90a" is Hopper with its architecture-specific instructions (wgmma); Triton emits those for 9.0 itself.
ARCHS = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90, "sm_90a": 90}


def hopper_tile(head_dim: int) -> configs.KernelConfig:
    """The Hopper forward's tile as a KernelConfig (for labels and num_warps): query rows per program, the key
    block, the first consumer's 4 warps; copy-engine loads and warp specialisation always."""
    width = hopper_launch.TILE_WIDTH[head_dim]
    return configs.KernelConfig(2 * hopper_launch.QUERY_ROWS_PER_CONSUMER, hopper_launch.KEY_BLOCK[width], 4, 1,
                                tma=True, warp_specialize=True)


def hopper_backward_tile(head_dim: int, flag: str = "") -> configs.KernelConfig:
    """The Hopper backward's tile (with the build flag ``flag`` set, if any): query rows per step, keys per program,
    the compute partition's 8 warps, the Q/dO slots."""
    width = hopper_launch.TILE_WIDTH[head_dim]
    rows = hopper_launch.backward_query_block(head_dim, flag == "DROPOUT", flag == "SOFTCAP", flag == "KEY_STARTS")
    return configs.KernelConfig(rows, hopper_launch.BACKWARD_KEY_BLOCK[width], 8, hopper_launch.BACKWARD_STAGES[width],
                                tma=True, warp_specialize=True)


@dataclass(frozen=True)
class KernelTask:
    """One kernel to compile: which kernel, for which problem class and tile."""

    kind: str            # "fwd", "dkdv", "dq", "short_bwd", "splitkv" / "combine" / "append_kv" (decode.py),
    #                      "hopper_fwd" / "hopper_bwd" (Gluon)
    head_dim: int
    causal: bool
    tile: configs.KernelConfig
    dq_mode: int = 0     # dK/dV kernel only: 0 separate dQ kernel, 1 atomics, 2 bulk reduce-add
    dtype: str = "bf16"
    flags: tuple = ()    # (name, value) pairs overriding compile-time flags, e.g. (("VARLEN", True),)

    @property
    def label(self) -> str:
        mode = f" dq={configs.DQ_MODES[self.dq_mode]}" if self.kind == "dkdv" else ""
        flags = "".join(f" {name}={value}" for name, value in self.flags)
        return f"{self.kind} d={self.head_dim} causal={int(self.causal)} tile={self.tile}{mode} {self.dtype}{flags}"


def _kernel_function(kind: str):
    from mhattn.backends.triton import backward, decode, forward

    if kind == "hopper_fwd":
        from mhattn.backends.triton import hopper_forward

        return hopper_forward.hopper_forward_kernel
    if kind == "hopper_bwd":
        from mhattn.backends.triton import hopper_backward

        return hopper_backward.hopper_backward_kernel
    return {"fwd": forward.attention_forward_kernel, "dkdv": backward.backward_dkdv_kernel,
            "dq": backward.backward_dq_kernel, "short_bwd": backward.backward_short_kernel,
            "splitkv": decode.split_kv_kernel,
            "combine": decode.combine_splits_kernel, "append_kv": decode.append_kv_kernel}[kind]


def _constexprs(task: KernelTask) -> dict:
    if task.kind == "hopper_fwd":
        return dict(hopper_launch.compile_time_args(task.head_dim, task.causal), **dict(task.flags))
    if task.kind == "hopper_bwd":
        flags = dict(task.flags)
        return dict(hopper_launch.backward_compile_time_args(task.head_dim, task.causal,
                                                             dropout=flags.get("DROPOUT", False),
                                                             softcap=flags.get("SOFTCAP", False),
                                                             key_starts=flags.get("KEY_STARTS", False)), **flags)
    padded = configs.padded_head_dim(task.head_dim)
    if task.kind == "combine":  # the split-KV combine (decode.py), 32 splits a row
        return dict(HEAD_DIM_V=task.head_dim, BLOCK_DV=padded, BLOCK_S=32, **dict(task.flags))
    if task.kind == "append_kv":  # the KV cache's append (decode.py)
        return {**dict(HEAD_DIM=task.head_dim, HEAD_DIM_V=task.head_dim, BLOCK_D=padded, BLOCK_DV=padded,
                       BLOCK_M=task.tile.block_m, PAGED=False, PAGE_SIZE=1), **dict(task.flags)}
    values = dict(HEAD_DIM=task.head_dim, HEAD_DIM_V=task.head_dim, BLOCK_D=padded, BLOCK_DV=padded,
                  BLOCK_M=task.tile.block_m, BLOCK_N=task.tile.block_n, HAS_LEFT=False, HAS_RIGHT=task.causal,
                  HAS_SOFTCAP=False, MASK_KIND=0, HAS_DROPOUT=False, DOT_PRECISION="tf32")
    if task.kind in ("fwd", "dq"):
        values["HEAVY_FIRST"] = task.causal
    if task.kind == "dq":
        values["MASK_GRAD"] = False
    if task.kind in ("fwd", "dkdv"):
        values.update(TMA=task.tile.tma, WARP_SPECIALIZE=task.tile.warp_specialize)
    if task.kind == "dkdv":
        values["DQ_MODE"] = task.dq_mode
    if task.kind == "splitkv":  # the split-KV decoding kernel (decode.py): no dropout, a cache or not (its flags)
        del values["HAS_DROPOUT"]
        values.update(HAS_SEQLENS=False, PAGED=False, PAGE_SIZE=1, SPLIT=True)
    values.update(dict(task.flags))
    return values


def compile_kernel(task: KernelTask, cc: int = 90):
    """Triton's compiled kernel for ``task`` on compute capability ``cc`` (e.g. 90); raises on failure."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel_function(task.kind)
    constexprs = _constexprs(task)
    signature, attrs = _tensor_map_types(task), {}
    for i, name in enumerate(fn.arg_names):
        if name in signature:
            continue
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INT32_POINTERS:
            signature[name] = "*i32"
        elif name in POINTERS:
            fp32 = name in FP32_POINTERS or (name in PARTIAL_SUMS and constexprs.get("PARTIAL_DK_DV"))
            signature[name] = "*fp32" if fp32 else "*" + task.dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            # (a 1-D index tensor's stride and a block table's column stride are 1 as a rule: no hint)
            if name.startswith("stride_") and not name.endswith(("mh", "mq", "mk", "lb", "lh", "seqlens", "table_block")):
                attrs[(i,)] = [["tt.divisibility", 16]]
    if task.kind in GLUON_KINDS:
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    else:
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=task.tile.num_warps, num_stages=task.tile.num_stages, **COMPILE_OPTIONS)
    if dict(task.flags).get("WAIT_PRIMARY"):  # launched as a programmatic dependent (decode_launch.DEPENDENT_LAUNCH)
        options["launch_pdl"] = True
    return triton.compile(source, target=GPUTarget("cuda", cc, 32), options=options)


def _tensor_map_types(task: KernelTask) -> dict:
    """The Gluon kernels' host tensor map arguments -> their Triton types, from maps hopper_launch makes of small
    CPU tensors of the task's dtype (the type holds the dtype, block shape and layout only)."""
    if task.kind not in GLUON_KINDS:
        return {}
    import torch
    from triton.runtime.jit import mangle_type

    d, dtype = task.head_dim, _torch_dtype(task.dtype)
    rows = torch.empty(1, 1, 256, d, dtype=dtype)
    if task.kind == "hopper_fwd":
        maps = hopper_launch.forward_maps(rows, rows, rows, rows, d)
        return dict(zip(("q_desc", "k_desc", "v_desc", "o_desc"), map(mangle_type, maps)))
    per_row = torch.empty(1, 1, 256, dtype=torch.float32)
    maps = hopper_launch.backward_maps(rows, rows, rows, rows, per_row, per_row, rows.float(), rows, rows, d,
                                       _constexprs(task)["BLOCK_M"])
    names = ("q_desc", "k_desc", "v_desc", "do_desc", "lse2_desc", "delta_desc", "dq_desc", "dk_desc", "dv_desc")
    return dict(zip(names, map(mangle_type, maps)))


def _nvidia_tool(name: str) -> str:
    """The path of a CUDA tool (cuobjdump, ptxas, ...) that ships with Triton's NVIDIA backend."""
    import os

    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resource_usage(kernel) -> dict:
    """{"regs": registers per thread, "stack": stack bytes per thread (register spills)} of a compiled kernel,
    from ``cuobjdump --dump-resource-usage`` of its cubin (the tool ships with Triton's NVIDIA backend)."""
    import re
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"regs": int(found.group(1)), "stack": int(found.group(2))}


def wgmma_notes(kernel) -> list:
    """ptxas's notes on the wgmma of a kernel compiled for sm_90a (backends/ptxas_notes.py): its PTX assembled again
    with ``-v`` by the ptxas Triton's build took (the one that reads its PTX version), which that build keeps quiet."""
    import os
    import subprocess
    import tempfile

    try:  # (Triton >= 3.5: a newer ptxas for sm_90 and up beside the legacy one)
        from triton.backends.nvidia.compiler import get_ptxas

        tool = get_ptxas(90).path
    except (ImportError, AttributeError, TypeError):
        tool = _nvidia_tool("ptxas")
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([tool, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(folder, "kernel.cubin")],
                                capture_output=True, text=True)
    if report.returncode != 0:
        raise RuntimeError(f"ptxas failed on the kernel's PTX: {report.stderr.strip()[:2000]}")
    return ptxas_notes.wgmma_notes(report.stdout + report.stderr)


def table_tasks(arch: str, head_dims=(64, 128, 256)) -> list:
    """Every kernel the table launches for 16-bit inputs on ``arch`` (sm_90a: only the entries that use the
    Hopper switches, i.e. what differs from plain sm_90 code)."""
    cc = ARCHS.get(arch)
    if cc is None:
        raise ValueError(f"--arch: unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    hopper_only = arch == "sm_90a"
    tasks = []
    for head_dim in head_dims:
        for causal in (False, True):
            config = configs.table_config((cc // 10, cc % 10), _torch_dtype("bf16"), head_dim, causal)
            dq_mode = configs.DQ_MODES.index(config.dq_mode)
            for kind, tile in (("fwd", config.forward), ("dkdv", config.dkdv), ("dq", config.dq)):
                if hopper_only and not (tile.tma or tile.warp_specialize or (kind == "dkdv" and dq_mode)):
                    continue
                tasks.append(KernelTask(kind, head_dim, causal, tile, dq_mode if kind == "dkdv" else 0))
            key = (configs.arch_of((cc // 10, cc % 10)), "half", configs.padded_head_dim(head_dim), causal)
            short_tiles = configs.SHORT_FORWARD.get(key, ()) + configs.SHORT_FORWARD_MASKED.get(key, ())
            for _, tile in short_tiles:  # the short queries' forward tiles (without and with a mask)
                task = KernelTask("fwd", head_dim, causal, tile)
                if tile != config.forward and task not in tasks and not (hopper_only and not tile.tma):
                    tasks.append(task)
            width = hopper_launch.TILE_WIDTH.get(head_dim)
            if cc == 90 and width is not None:  # the Gluon kernels (sm_90 only)
                tasks.append(KernelTask("hopper_fwd", head_dim, causal, hopper_tile(head_dim)))
                if causal:  # the persistent grid's programs take causal tiles from a counter
                    tasks.append(KernelTask("hopper_fwd", head_dim, causal, hopper_tile(head_dim),
                                            flags=(("TILE_COUNTER", True),)))
                if causal and width in hopper_launch.FORWARD_HALF_DIAGONAL_MAX_KEYS:  # up to that many keys
                    tasks.append(KernelTask("hopper_fwd", head_dim, causal, hopper_tile(head_dim),
                                            flags=(("TILE_COUNTER", True), ("HALF_DIAGONAL", True))))
                if width in hopper_launch.FORWARD_Q_ROTATING_MAX_KEYS:  # three Q slots, up to that many keys
                    tasks.append(KernelTask("hopper_fwd", head_dim, causal, hopper_tile(head_dim),
                                            flags=(("TILE_COUNTER", causal), ("Q_ROTATING", True))))
                # A sliding window (left bound), causal (the usual case, its persistent grid from a counter) or not;
                # a right-padding key mask as key counts; dropout; a softcap.
                for flag in ("WINDOW", "KEY_LENGTHS", "DROPOUT", "SOFTCAP"):
                    tasks.append(KernelTask("hopper_fwd", head_dim, causal, hopper_tile(head_dim),
                                            flags=(("TILE_COUNTER", causal), (flag, True))))
                # a left-padding key mask as each sequence's first key and key count, and with dropout where the
                # dropout forward runs the Gluon kernel
                starts = (("TILE_COUNTER", causal), ("KEY_LENGTHS", True), ("KEY_STARTS", True))
                tasks.append(KernelTask("hopper_fwd", head_dim, causal, hopper_tile(head_dim), flags=starts))
                if width in hopper_launch.FORWARD_DROPOUT_HEAD_DIMS:
                    tasks.append(KernelTask("hopper_fwd", head_dim, causal, hopper_tile(head_dim),
                                            flags=starts + (("DROPOUT", True), )))
            if cc == 90 and width in hopper_launch.BACKWARD_MIN_KEYS:
                # (the tile's flag, the build's flags): plain, each feature alone, and a left-padding key mask alone
                # and with dropout or deterministic
                builds = [("", ())] + [(flag, ((flag, True), )) for flag in
                                       ("WINDOW", "KEY_LENGTHS", "DROPOUT", "SOFTCAP", "DETERMINISTIC")]
                starts = (("KEY_LENGTHS", True), ("KEY_STARTS", True))
                builds += [("KEY_STARTS", starts + extra) for extra in ((), (("DROPOUT", True), ),
                                                                         (("DETERMINISTIC", True), ))]
                # and each that is not deterministic with GQA's partial dK and dV sums (hopper_launch.group_parts)
                if width == head_dim and head_dim <= 128:
                    builds += [(flag, flags + (("PARTIAL_DK_DV", True), )) for flag, flags in builds
                               if "DETERMINISTIC" not in dict(flags)]
                tasks += [KernelTask("hopper_bwd", head_dim, causal, hopper_backward_tile(head_dim, flag), flags=flags)
                          for flag, flags in builds]
        if not hopper_only:
            widest = short_backward_widest_tile(head_dim)
            tasks += [KernelTask("short_bwd", head_dim, causal, widest) for causal in (False, True) if widest]
            tasks += split_kv_tasks(head_dim, cc)
    return tasks


def short_backward_widest_tile(head_dim: int) -> configs.KernelConfig:
    """The short backward's tile at the most keys it takes at ``head_dim`` (the most registers it holds); None where
    it takes none."""
    padded = configs.padded_head_dim(head_dim)
    keys = min(configs.SHORT_BACKWARD_MAX_KEYS, configs.SHORT_BACKWARD_ACCUMULATORS // (2 * padded))
    return configs.short_backward_tile(keys, padded, padded)


def split_kv_tasks(head_dim: int, cc: int = 80) -> list:
    """The split-KV decoding kernels (decode.py) as decoding launches them at ``head_dim`` on compute capability
    ``cc``: the split kernel with several splits, one query head group of 4 rows, over a contiguous cache and a
    paged one (blocks of 256 keys), and over a contiguous cache appending the step's new keys and values itself,
    then the combine; from sm_90 the combine as a programmatic dependent launch
    of the split kernel (decode_launch.DEPENDENT_LAUNCH); the KV cache's append into each kind of cache; last, on
    sm_90, the three split kernels again with decode_launch.HOPPER_SPLIT_TILES' tile where the head dim has one (the
    split grids of Hopper GPUs with HBM3e)."""
    from mhattn.backends.triton import decode_launch

    padded = configs.padded_head_dim(head_dim)
    dependent = cc >= 90
    tasks = []
    # A dense step, a paged step, and a contiguous cache's step with its append inside (APPEND).
    steps = ((False, False), (True, False), (False, True))
    for paged, append in steps:
        tasks.append(_split_kv_task(head_dim, decode_launch.decode_tile(padded, padded, 2, paged), paged, append,
                                    dependent))
    combine_tile = configs.KernelConfig(1, 1, decode_launch.combine_warps(padded), 1)
    tasks.append(KernelTask("combine", head_dim, True, combine_tile,
                            flags=(("WAIT_PRIMARY", dependent),)))
    append_tile = configs.KernelConfig(decode_launch.APPEND_BLOCK_M, 1, decode_launch.append_warps(head_dim, head_dim),
                                       1)
    for paged in (False, True):
        tasks.append(KernelTask("append_kv", head_dim, False, append_tile,
                                flags=(("PAGED", paged), ("PAGE_SIZE", 256 if paged else 1))))
    if cc // 10 == 9 and padded in decode_launch.HOPPER_SPLIT_TILES:
        tile = decode_launch.HOPPER_SPLIT_TILES[padded]
        tasks += [_split_kv_task(head_dim, tile, paged, append, dependent) for paged, append in steps]
    # A dense step with a key-padding bias (B, 1, 1, Nk) in the inputs' dtype (a boolean mask compiles the same loads
    # of one key row a block), and one with a bias that varies over the query rows (a speculative step's).
    tile = decode_launch.decode_tile(padded, padded, 2, False)
    tasks += [_split_kv_task(head_dim, tile, False, False, dependent, kind)
              for kind in (scores.MASK_KEYS_FLOAT, scores.MASK_FLOAT)]
    return tasks


def _split_kv_task(head_dim: int, tile, paged: bool, append: bool, dependent: bool, mask_kind: int = 0) -> KernelTask:
    """The split kernel at ``tile`` (decode_launch.DecodeTile) over a paged cache or not, appending or not, with a
    mask of ``mask_kind`` (decode_launch.mask_kind) or none."""
    flags = (("PAGED", paged), ("HAS_SEQLENS", paged or append), ("PAGE_SIZE", 256 if paged else 1),
             ("RELEASE_DEPENDENTS", dependent), ("APPEND", append)) + ((("MASK_KIND", mask_kind),) if mask_kind else ())
    config = configs.KernelConfig(16, tile.block_n, tile.num_warps, tile.num_stages)
    return KernelTask("splitkv", head_dim, True, config, flags=flags)


def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def compile_task(job):
    """For a process pool: (task, cc) -> (label, error or None)."""
    task, cc = job
    try:
        compile_kernel(task, cc)
        return task.label, None
    except Exception as error:  # one failing kernel must not hide the others
        return task.label, f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:500]}"
