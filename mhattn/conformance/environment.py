"""What machine a conformance run ran on: device, driver and library versions, as plain strings."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess

import torch


def _module_version(name: str) -> str:
    try:
        module = importlib.import_module(name)
    except Exception as error:
        return f"not available ({type(error).__name__})"
    return str(getattr(module, "__version__", "installed"))


def _nvidia_smi_driver() -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ""
    try:
        done = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=15)
    except Exception:
        return ""
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""


def _cupy_versions() -> dict:
    found = {}
    try:
        import cupy
    except Exception as error:
        return {"cupy": f"not available ({type(error).__name__})"}
    found["cupy"] = cupy.__version__
    try:
        from cupy_backends.cuda.libs import nvrtc

        found["nvrtc"] = "%d.%d" % tuple(nvrtc.getVersion())
    except Exception as error:
        found["nvrtc"] = f"not available ({type(error).__name__})"
    if torch.cuda.is_available():
        try:
            version = cupy.cuda.runtime.driverGetVersion()
            found["cuda driver API"] = f"{version // 1000}.{(version % 1000) // 10}"
        except Exception:
            pass
    return found


def describe_environment() -> dict:
    """Ordered name -> value strings: the device, the driver and every library the backends use."""
    import mhattn

    env = {
        "mhattn": mhattn.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
    }
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        major, minor = torch.cuda.get_device_capability(index)
        env["device"] = (f"cuda:{index} {props.name}, compute capability {major}.{minor}, "
                         f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.1f} GiB")
        driver = _nvidia_smi_driver()
        if driver:
            env["driver"] = driver
    else:
        env["device"] = f"CPU only (no CUDA GPU visible), {os.cpu_count()} cores"
    env["triton"] = _module_version("triton")
    env.update(_cupy_versions())
    interpret = os.environ.get("TRITON_INTERPRET", "")
    if interpret:
        env["TRITON_INTERPRET"] = interpret
    return env
