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
