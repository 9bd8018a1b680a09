"""Launching a Triton kernel through its compiled handle: the per-call host cost of a small attention call.

``kernel[grid](*args, **constexprs)`` costs about 50 us of host time per launch on an H100 host for the
attention kernels' ~60 arguments (Triton binds every argument, specialises it, builds and hashes the cache key
from strings, looks up the current device and stream), against about 15 us for calling the compiled
kernel's launcher with the same arguments. :class:`CompiledLauncher` makes the first launch of each
specialisation through Triton (which compiles and caches it) and keeps the compiled handle; later launches
with the same specialisation go straight to the handle.

The specialisation key is computed here from the very things Triton specialises on, so a handle is reused
only where Triton would have picked the same compiled kernel:
- each tensor argument's dtype and whether its address is 16-byte aligned;
- each host tensor map's (Gluon ``TensorDescriptor``) dtype, block shape and shared-memory layout (Triton types
  it by those alone);
- the exact value of each integer argument Triton specialises (equal to 1, divisible by 16), and, for the
  integer arguments it does not specialise (``do_not_specialize``), whether they all fit in int32 (Triton
  types them i32 or i64 by value);
- the Python type of every argument (float arguments are always fp32, bools i1);
- the compile-time arguments, num_warps, num_stages and any other compile option asked for (e.g. ``launch_pdl``,
  programmatic dependent launch: a :class:`ConstexprSet`, built once per plan);
- the current device.
A launch through a kept handle passes each tensor as its address (an int), which Triton's launcher takes as it is;
given the tensor, it would call ``data_ptr`` and ask the driver about the pointer (``cuPointerGetAttribute``), once
per tensor argument at every launch. Every tensor a backend launches with was checked to be on the launching GPU.
Anything unusual (Triton's interpreter, a launch hook installed by a profiler) takes Triton's own path.
"""

from __future__ import annotations

import inspect
import itertools
import operator
from typing import Optional

import torch

from mhattn.backends.streams import current_stream
from mhattn.caches import put_bounded

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_EMPTY = inspect.Parameter.empty
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_LOW_BITS = (15).__and__

# Compile options of every launch of the backend's kernels. The kernels are written for fused multiply-adds (e.g. the
# softmax's exponent argument, scores * scale - row maximum, as one instruction): Triton up to 3.9 fuses by default,
# and its default is to change to no fusion (TRITON_DEFAULT_FP_FUSION), which would slow the kernels and change their
# rounding, so the launches ask for fusion themselves.
COMPILE_OPTIONS = dict(enable_fp_fusion=True)

# Compiled handles kept per launcher; beyond this the oldest makes room (a program with ever-new
# shapes or strides keeps working, at Triton's cost for the new ones).
HANDLES_LIMIT = 1024


class ConstexprSet:
    """The compile-time arguments of one kernel configuration, in the kernel's parameter order (what the
    compiled launcher takes after the runtime arguments), with num_warps, num_stages and other compile options
    (``options``, e.g. ``{"launch_pdl": True}``; the kept handle's launcher reads them from the compiled kernel):
    hashable, made once per plan and tile so that no per-call dict is built."""

    __slots__ = ("kwargs", "values", "num_warps", "num_stages", "options", "key")

    def __init__(self, launcher: "CompiledLauncher", kwargs: dict, num_warps: int, num_stages: int,
                 options: Optional[dict] = None):
        self.kwargs = dict(kwargs)
        self.num_warps, self.num_stages = num_warps, num_stages
        self.options = dict(COMPILE_OPTIONS, **(options or {}))
        if launcher.interpret:
            self.values, self.key = (), None
            return
        unknown = set(kwargs) - set(launcher.constexpr_names)
        if unknown:
            raise TypeError(f"{launcher.name}: not compile-time parameters: {sorted(unknown)}")
        missing = [n for n in launcher.constexpr_names if n not in kwargs and launcher.constexpr_defaults[n] is _EMPTY]
        if missing:
            raise TypeError(f"{launcher.name}: compile-time parameters without a value: {missing}")
        self.values = tuple(kwargs.get(name, launcher.constexpr_defaults[name]) for name in launcher.constexpr_names)
        self.key = (self.values, num_warps, num_stages, tuple(sorted(self.options.items())))


class _ArgumentKinds:
    """Where the tensors, the host tensor maps and the integers sit in a runtime argument tuple of one type
    pattern; ``with_addresses(args + addresses)`` is ``args`` with each tensor replaced by its address (the
    addresses in the tensors' order)."""

    __slots__ = ("tensors", "tensor_maps", "specialized_ints", "plain_ints", "with_addresses")

    def __init__(self, types: tuple, do_not_specialize: frozenset):
        tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
        ints = [i for i, t in enumerate(types) if t is int]
        self.tensors = _getter(tensors)
        address_of = {position: len(types) + j for j, position in enumerate(tensors)}
        self.with_addresses = _getter([address_of.get(i, i) for i in range(len(types))])
        self.tensor_maps = _getter([i for i, t in enumerate(types) if t.__name__ == "TensorDescriptor"])
        self.specialized_ints = _getter([i for i in ints if i not in do_not_specialize])
        self.plain_ints = _getter([i for i in ints if i in do_not_specialize])


def _getter(indices):
    """A function of a tuple returning the items at ``indices`` as a tuple (C speed for 2+ items)."""
    if not indices:
        return lambda args: ()
    if len(indices) == 1:
        index = indices[0]
        return lambda args: (args[index],)
    return operator.itemgetter(*indices)


class CompiledLauncher:
    """Launches one ``@triton.jit`` kernel whose compile-time parameters all follow its runtime ones.

    ``launch(grid, args, constexprs)``: ``args`` the runtime arguments in order (a tuple), ``constexprs`` a
    :class:`ConstexprSet` from :meth:`constexprs`."""

    def __init__(self, kernel, interpret: bool = False):
        self.kernel = kernel
        self.name = getattr(kernel, "__name__", repr(kernel))
        self.interpret = interpret
        self.handles: dict = {}
        self._kinds: dict = {}
        self._constexpr_sets: dict = {}
        self._sites: dict = {}  # a prepared launch's fixed part of the key -> a small int standing for it
        self._site_ids = itertools.count()  # next() is atomic: threads preparing at once get distinct ids
        self.handle_launches = 0  # launches that went through a kept handle (for tests and profiles)
        if interpret:  # Triton's interpreter: every launch goes through it (its kernels have no parameter list)
            self.num_runtime, self.constexpr_names, self.constexpr_defaults = None, None, {}
            self.do_not_specialize = frozenset()
            return
        params = kernel.params
        first_constexpr = next((i for i, p in enumerate(params) if p.is_constexpr), len(params))
        if any(not p.is_constexpr for p in params[first_constexpr:]):
            raise TypeError(f"{self.name}: compile-time parameters must follow every runtime parameter")
        self.num_runtime = first_constexpr
        self.constexpr_names = tuple(p.name for p in params[first_constexpr:])
        self.constexpr_defaults = {p.name: p.default for p in params[first_constexpr:]}
        self.do_not_specialize = frozenset(i for i, p in enumerate(params[:first_constexpr]) if p.do_not_specialize)

    def constexprs(self, num_warps: int, num_stages: int, options: Optional[dict] = None, **kwargs) -> ConstexprSet:
        return ConstexprSet(self, kwargs, num_warps, num_stages, options)

    def cached_constexprs(self, num_warps: int, num_stages: int, options: Optional[dict] = None,
                          **kwargs) -> ConstexprSet:
        """:meth:`constexprs`, kept per distinct set (for call sites without a plan to keep it in)."""
        key = (num_warps, num_stages, tuple(sorted((options or {}).items())), *kwargs.items())
        found = self._constexpr_sets.get(key)
        if found is None:
            found = put_bounded(self._constexpr_sets, key, ConstexprSet(self, kwargs, num_warps, num_stages, options),
                                HANDLES_LIMIT)
        return found

    def specialization_key(self, device_index: int, args: tuple, constexprs: ConstexprSet):
        """What selects the compiled kernel for these arguments (see the module's docstring)."""
        return self._key_and_addresses(device_index, args, constexprs)[0]

    def _key_and_addresses(self, device_index: int, args: tuple, constexprs: ConstexprSet):
        """The specialisation key, the argument kinds and the tensors' addresses."""
        types = tuple(map(type, args))
        kinds = self._kinds.get(types)
        if kinds is None:
            kinds = self._kinds[types] = _ArgumentKinds(types, self.do_not_specialize)
        tensors = kinds.tensors(args)
        addresses = tuple(map(_DATA_PTR, tensors))
        plain = kinds.plain_ints(args)
        plain_fit = not plain or (min(plain) >= INT32_MIN and max(plain) <= INT32_MAX)
        maps = tuple((m.base.dtype, tuple(m.block_shape), m.layout) for m in kinds.tensor_maps(args))
        # Each address's offset from a 16-byte boundary (finer than Triton's aligned-or-not: never coarser).
        key = (device_index, types, tuple(map(_DTYPE, tensors)), tuple(map(_LOW_BITS, addresses)),
               kinds.specialized_ints(args), plain_fit, constexprs.key, maps)
        return key, kinds, addresses

    def launch(self, grid: tuple, args: tuple, constexprs: ConstexprSet, device_index: Optional[int] = None):
        """Launch on the current stream of the current device (``device_index`` when given: the caller made it
        current)."""
        if self.interpret:
            self._launch_through_triton(grid, args, constexprs)
            return
        if len(args) != self.num_runtime:
            raise TypeError(f"{self.name}: expected {self.num_runtime} runtime arguments, got {len(args)}")
        if _launch_hooks_set():
            self._launch_through_triton(grid, args, constexprs)
            return
        if device_index is None:
            device_index = torch.cuda.current_device()
        key, kinds, addresses = self._key_and_addresses(device_index, args, constexprs)
        handle = self.handles.get(key)
        if handle is None:
            self._keep(key, self._launch_through_triton(grid, args, constexprs))
            return
        run, function, packed_metadata = handle
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], grid_1, grid_2, current_stream(device_index), function, packed_metadata,
            None, None, None, *kinds.with_addresses(args + addresses), *constexprs.values)
        self.handle_launches += 1

    def prepare(self, grid: tuple, args: tuple, constexprs: ConstexprSet, device_index: int) -> "PreparedLaunch":
        """A :class:`PreparedLaunch` of this kernel on ``grid`` for argument tuples that differ from ``args`` in
        their tensors only (same positions; every other argument equal)."""
        return PreparedLaunch(self, grid, args, constexprs, device_index)

    def prepare_maps(self, grid: tuple, args: tuple, constexprs: ConstexprSet,
                     device_index: int) -> "PreparedMapLaunch":
        """A :class:`PreparedMapLaunch` of this kernel on ``grid``: ``args`` with host tensor maps, whose geometry
        the later launches keep (they pass each map's tensor in its place)."""
        return PreparedMapLaunch(self, grid, args, constexprs, device_index)

    def _site_id(self, static: tuple) -> int:
        """The int standing for ``static`` in kept handles' keys; ids are never reused, so an evicted entry's
        handles cannot be taken for another's."""
        site = self._sites.get(static)
        if site is None:
            site = put_bounded(self._sites, static, next(self._site_ids), HANDLES_LIMIT)
        return site

    def _keep(self, key, compiled) -> None:
        """Keep the handle of a kernel Triton just compiled (or found) for later launches with ``key``."""
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            put_bounded(self.handles, key, (compiled.run, compiled.function, compiled.packed_metadata), HANDLES_LIMIT)

    def _launch_through_triton(self, grid, args, constexprs: ConstexprSet):
        return self.kernel[grid](*args, **constexprs.kwargs, num_warps=constexprs.num_warps,
                                 num_stages=constexprs.num_stages, **constexprs.options)


class PreparedLaunch:
    """One launch site of a :class:`CompiledLauncher` whose grid, compile-time set and non-tensor arguments are
    fixed (a plan's launch of one tile): the part of the specialisation key they give (argument types, the
    specialised integers, whether the others fit in int32, the compile-time set, the device) is worked out
    once, so a launch reads only its tensors' dtypes and addresses. ``launch(args)`` takes tuples equal to
    the ``args`` it was prepared with except in their tensors; the caller keys its prepared launches by
    everything the other arguments come from."""

    __slots__ = ("launcher", "grid", "constexprs", "device_index", "tensors", "with_addresses", "site", "run_grid")

    def __init__(self, launcher: CompiledLauncher, grid: tuple, args: tuple, constexprs: ConstexprSet,
                 device_index: int):
        self.launcher, self.grid, self.constexprs, self.device_index = launcher, grid, constexprs, device_index
        self.run_grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.tensors = self.with_addresses = self.site = None
        if launcher.interpret:
            return
        if len(args) != launcher.num_runtime:
            raise TypeError(f"{launcher.name}: expected {launcher.num_runtime} runtime arguments, got {len(args)}")
        full = launcher.specialization_key(device_index, args, constexprs)
        if full[7]:  # a map's type would have to be read per call, like a tensor's dtype
            raise TypeError(f"{launcher.name}: host tensor maps are launched through CompiledLauncher.launch")
        kinds = launcher._kinds[full[1]]
        self.tensors, self.with_addresses = kinds.tensors, kinds.with_addresses
        # The key without the tensors' dtypes and address bits, as one small int: no long tuple hashed per call.
        static = (device_index, full[1], full[4], full[5], constexprs.key)
        self.site = launcher._site_id(static)

    def launch(self, args: tuple) -> None:
        launcher = self.launcher
        if self.site is None or _launch_hooks_set():
            launcher.launch(self.grid, args, self.constexprs, self.device_index)
            return
        tensors = self.tensors(args)
        addresses = tuple(map(_DATA_PTR, tensors))
        key = (self.site, tuple(map(_DTYPE, tensors)), tuple(map(_LOW_BITS, addresses)))
        try:
            handle = launcher.handles[key]
        except KeyError:  # a new specialisation: Triton compiles (or finds) it
            compiled = launcher._launch_through_triton(self.grid, args, self.constexprs)
            launcher._keep(key, compiled)
            return
        run, function, packed_metadata = handle
        run(*self.run_grid, current_stream(self.device_index), function, packed_metadata, None, None, None,
            *self.with_addresses(args + addresses), *self.constexprs.values)
        launcher.handle_launches += 1


# Encoded tensor maps a prepared map launch keeps per map argument, by base address (a training step of many layers
# passes each site a few dozen addresses; beyond this the oldest makes room).
ENCODED_MAPS_LIMIT = 256
_NOT_LOOKED = object()


class PreparedMapLaunch:
    """A launch site of a kernel that reads tensors through host tensor maps (Gluon ``TensorDescriptor``) of a fixed
    geometry (shape, strides, block shape, layout), with its grid, compile-time set and other non-tensor arguments
    fixed too: ``launch(args)`` takes the runtime arguments with each map's place holding the tensor it maps (of the
    dtype the site was prepared with, 16-byte aligned: the caller's checks).

    Triton's launcher (3.6) encodes each map at every launch (the driver's ``cuTensorMapEncodeTiled``) inside a
    Python loop over every argument: 10.8 us of a Gluon forward's host time for its four maps on the H100 host
    (backends/triton/NOTES.md). Where a compiled kernel's launcher is laid out as Triton 3.6 lays it out
    (:func:`_direct_launch`), this site calls Triton's C launch function itself, with the arguments Triton's wrapper
    would pass it, each map encoded by Triton's own encoder once per base address and kept: a map holds only the
    address and the site's fixed geometry, so a kept one is the one a fresh encoding would give. Otherwise (another
    Triton's layout, launch hooks, a kernel that needs scratch memory) it makes the descriptors and launches through
    :meth:`CompiledLauncher.launch`."""

    __slots__ = ("launcher", "grid", "constexprs", "device_index", "descriptors", "map_positions", "bases", "tensors",
                 "tensor_positions", "site", "direct")

    def __init__(self, launcher: CompiledLauncher, grid: tuple, args: tuple, constexprs: ConstexprSet,
                 device_index: int):
        if launcher.interpret:
            raise TypeError(f"{launcher.name}: host tensor maps need a GPU launch, not Triton's interpreter")
        if len(args) != launcher.num_runtime:
            raise TypeError(f"{launcher.name}: expected {launcher.num_runtime} runtime arguments, got {len(args)}")
        self.launcher, self.grid, self.constexprs, self.device_index = launcher, grid, constexprs, device_index
        full = launcher.specialization_key(device_index, args, constexprs)
        types = full[1]
        self.map_positions = tuple(i for i, t in enumerate(types) if t.__name__ == "TensorDescriptor")
        if not self.map_positions:
            raise TypeError(f"{launcher.name}: no host tensor maps (CompiledLauncher.prepare launches those)")
        # The maps' geometry, without the first call's tensors (a site lives as long as its call signature's cache
        # entry, and must not keep that call's q, k, v and outputs alive).
        self.descriptors = tuple(with_base(args[i], None) for i in self.map_positions)
        self.bases = _getter(self.map_positions)
        self.tensor_positions = tuple(i for i, t in enumerate(types) if issubclass(t, torch.Tensor))
        self.tensors = _getter(self.tensor_positions)
        # What the site fixes of the specialisation key (maps typed by dtype, block shape and layout), as one int.
        self.site = launcher._site_id(("maps", device_index, types, full[4], full[5], constexprs.key, full[7]))
        self.direct: dict = {}  # per-call key -> its _DirectLaunch, or None where Triton's path launches

    def launch(self, args: tuple) -> None:
        if _launch_hooks_set():
            self._through_launcher(args)
            return
        tensors = self.tensors(args)
        addresses = tuple(map(_DATA_PTR, tensors))
        bases = self.bases(args)
        key = (self.site, tuple(map(_DTYPE, tensors)), tuple(map(_LOW_BITS, addresses)), tuple(map(_DTYPE, bases)))
        direct = self.direct.get(key, _NOT_LOOKED)
        if direct is _NOT_LOOKED:  # this specialisation's first launch here: Triton's path, then its handle
            full_args = self._through_launcher(args)
            handle = self.launcher.handles.get(self.launcher.specialization_key(self.device_index, full_args,
                                                                                self.constexprs))
            put_bounded(self.direct, key, None if handle is None else _DirectLaunch.of(self, handle, full_args),
                        HANDLES_LIMIT)
            return
        if direct is None:
            self._through_launcher(args)
            return
        direct.launch(current_stream(self.device_index), addresses, bases)
        self.launcher.handle_launches += 1

    def _through_launcher(self, args: tuple) -> tuple:
        """Launch with the maps made from the site's geometry and ``args``' tensors (Triton's path, or the kept
        handle through Triton's launcher wrapper); returns the arguments it launched with."""
        full_args = list(args)
        for position, descriptor in zip(self.map_positions, self.descriptors):
            full_args[position] = with_base(descriptor, args[position])
        full_args = tuple(full_args)
        self.launcher.launch(self.grid, full_args, self.constexprs, self.device_index)
        return full_args


def with_base(descriptor, base):
    """A copy of a host tensor map (Gluon ``TensorDescriptor``) over ``base`` instead of its tensor."""
    copy = object.__new__(type(descriptor))
    copy.__dict__.update(descriptor.__dict__)
    copy.base = base
    return copy


class _DirectLaunch:
    """One specialisation of a :class:`PreparedMapLaunch` launched through Triton 3.6's C launch function: the
    argument list that function takes (the grid, the stream, the compiled function, the launch flags, then every
    kernel argument with each map expanded to its encoded map, its shape and its strides, then the compile-time
    values), with the stream, the tensors' addresses and the encoded maps filled in per call."""

    __slots__ = ("c_launch", "template", "address_slots", "map_slots", "encoded", "encode", "metas", "descriptors")

    @classmethod
    def of(cls, site: PreparedMapLaunch, handle: tuple, full_args: tuple) -> Optional["_DirectLaunch"]:
        found = _direct_launch(handle[0])
        return None if found is None else cls(site, handle, full_args, *found)

    def __init__(self, site: PreparedMapLaunch, handle: tuple, full_args: tuple, c_launch, metas, encode,
                 cooperative: bool, dependent: bool):
        _, function, packed_metadata = handle
        self.c_launch, self.metas, self.encode, self.descriptors = c_launch, metas, encode, site.descriptors
        grid = tuple(site.grid) + (1,) * (3 - len(site.grid))
        # Triton 3.6's order: grid, stream, function, cooperative grid, programmatic dependent launch, global and
        # profile scratch (none here), the kernel's metadata, launch metadata and the enter / exit hooks (none).
        template = [*grid, 0, function, cooperative, dependent, None, None, packed_metadata, None, None, None]
        address_slots, map_slots = [], []
        map_number = {position: n for n, position in enumerate(site.map_positions)}
        tensor_positions = set(site.tensor_positions)
        for position, value in enumerate(full_args):
            if position in map_number:
                n = map_number[position]
                map_slots.append(len(template))
                template.extend(encode(value, metas[n]))  # the encoded map, then the shape and strides it passes
            elif position in tensor_positions:
                address_slots.append(len(template))
                template.append(value.data_ptr())
            else:
                template.append(value)
        template.extend(site.constexprs.values)
        self.template, self.address_slots, self.map_slots = template, tuple(address_slots), tuple(map_slots)
        self.encoded = tuple({} for _ in map_slots)

    def launch(self, stream: int, addresses: tuple, bases: tuple) -> None:
        arguments = self.template.copy()
        arguments[3] = stream
        for slot, address in zip(self.address_slots, addresses):
            arguments[slot] = address
        for n, (slot, encoded, base) in enumerate(zip(self.map_slots, self.encoded, bases)):
            address = _DATA_PTR(base)
            tensor_map = encoded.get(address)
            if tensor_map is None:
                tensor_map = self.encode(with_base(self.descriptors[n], base), self.metas[n])[0]
                put_bounded(encoded, address, tensor_map, ENCODED_MAPS_LIMIT)
            arguments[slot] = tensor_map
        self.c_launch(*arguments)


def _direct_launch(run) -> Optional[tuple]:
    """(C launch function, the maps' metadata, Triton's map encoder, cooperative-grid flag, dependent-launch flag) of
    a compiled kernel's launcher laid out as Triton 3.6 lays it out: a ``launch`` closure over the C function (the
    wrapper that expands host tensor maps with ``make_tensordesc_arg`` and each map's metadata), behind a 13-item
    head of launch arguments, and no scratch memory to allocate per launch. None for any other layout."""
    launch = getattr(run, "launch", None)
    code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    if code is None or not closure:
        return None
    cells = dict(zip(code.co_freevars, closure))
    try:
        c_launch = cells["launcher"].cell_contents
        metas = tuple(cells["tensordesc_meta"].cell_contents)
        encode = launch.__globals__["make_tensordesc_arg"]
        head = launch.__globals__.get("_BASE_ARGS_FORMAT_LEN")
        scratch = run.global_scratch_size or run.profile_scratch_size
        flags = bool(run.launch_cooperative_grid), bool(run.launch_pdl)
    except (KeyError, AttributeError, ValueError, TypeError):
        return None
    if head != 13 or scratch or not metas or any(meta is None for meta in metas) or not callable(c_launch):
        return None
    return (c_launch, metas, encode, *flags)


def _launch_hooks_set() -> bool:
    """A profiler (e.g. Triton's proton) watches launches through Triton's hooks: leave them to Triton. Asked at
    every launch, so it reads the hooks without calling anything where it can."""
    runtime = _RUNTIME_KNOBS[0] if _RUNTIME_KNOBS else _runtime_knobs()
    if runtime is None:
        return False
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        # None (Triton 3.6) or an empty chain of hooks (later Triton) is no hook.
        if hook is not None:
            try:
                if hook.calls:
                    return True
            except AttributeError:  # a plain function set as the hook
                return True
    return False


_RUNTIME_KNOBS = []


def _runtime_knobs():
    if not _RUNTIME_KNOBS:
        try:
            from triton import knobs

            _RUNTIME_KNOBS.append(knobs.runtime)
        except Exception:  # pragma: no cover - a Triton without knobs has no hooks of this form
            _RUNTIME_KNOBS.append(None)
    return _RUNTIME_KNOBS[0]
