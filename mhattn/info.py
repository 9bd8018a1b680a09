"""``mhattn info``: what this machine has and what each backend can do on it."""

from __future__ import annotations

import importlib
import platform


def _version(module_name: str) -> str:
    try:
        return getattr(importlib.import_module(module_name), "__version__", "installed")
    except Exception as error:
        return f"not available ({type(error).__name__}: {error})"


def add_arguments(parser) -> None:
    parser.add_argument("--dtype", default=None, help="dtype of the sample problem (default: bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim of the sample problem")


def run(args) -> int:
    import torch

    import mhattn
    from mhattn import dispatch, registry
    from mhattn.errors import UnknownBackendError

    print(f"mhattn {mhattn.__version__}  python {platform.python_version()}  {platform.machine()}")
    print(f"torch  {torch.__version__}  (CUDA {torch.version.cuda})")
    print(f"triton {_version('triton')}")
    print(f"cupy   {_version('cupy')}")
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        cc = torch.cuda.get_device_capability(index)
        print(f"device cuda:{index} {props.name}, compute capability {cc[0]}.{cc[1]}, {props.multi_processor_count} SMs, "
              f"{props.total_memory / 2**30:.1f} GiB")
        device = torch.device("cuda", index)
    else:
        print("device no CUDA GPU visible: the CPU runs the reference backend")
        device = torch.device("cpu")
    print("\nbackends:")
    for backend in registry.all_backends():
        reasons = backend.unavailable()
        state = "available" if not reasons else "unavailable: " + "; ".join(reasons)
        print(f"  {backend.name:<10} {state}")
        if backend.description:
            print(f"  {'':<10} {backend.description}")
    try:
        dispatch.requested()
    except UnknownBackendError as error:  # a bad MHATTN_BACKEND: the call path's own message, no traceback
        print(f"\nerror: {error}")
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    q = torch.empty(2, 8, 1024, args.head_dim, device=device, dtype=dtype)
    print("\nsample problem (causal):")
    print("  " + str(mhattn.explain(q, q, q, is_causal=True)).replace("\n", "\n  "))
    return 0
