"""ptxas's performance notes on a Hopper kernel's wgmma, read from its verbose report (``ptxas -v``).

ptxas keeps a kernel correct whatever the code around its asynchronous matrix products does, and says so in a
C75xx note when it had to give up the asynchrony: every wgmma made to wait for the one before ("wgmma.mma_async
instructions are serialized due to ..."), or a wait injected where registers a wgmma writes are used too early. A
Hopper forward built so ran at three quarters of its speed on the H100 (backends/cupy/NOTES.md), so CI reads these
notes for every Hopper kernel it compiles (the CuPy backend's through NVRTC's log, the Gluon kernels' by assembling
Triton's PTX again with ``-v``).
"""


def wgmma_notes(report: str) -> list:
    """The C75xx notes of a ptxas report, each without ptxas's "ptxas info :" prefix."""
    return [line.split(":", 1)[-1].strip() for line in report.splitlines() if "(C75" in line]
