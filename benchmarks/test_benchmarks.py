"""pytest-benchmark timings of a few fixed shapes, so a regression shows between runs.

    pytest benchmarks/ --benchmark-only                              # on a GPU; skipped without one
    pytest benchmarks/ --benchmark-only --benchmark-autosave         # keep a run in .benchmarks/
    pytest benchmarks/ --benchmark-only --benchmark-compare          # compare with the last saved run

Each case times one implementation on one protocol shape (B*N = 16384, H = 2048/d, randn inputs):
the forward, or forward+backward. The mhattn backends are timed beside sdpa-flash; a backend that cannot
run a shape is skipped with its reasons, one that fails on a shape it claims fails the test. The TFLOP/s
of each case is in its extra_info (``--benchmark-json`` keeps it). Not collected by a plain ``pytest``
(pyproject's testpaths is tests/).
"""

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from mhattn.benchmark import protocol  # noqa: E402
from mhattn.benchmark.timing import describe_error  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]

# (dtype, head dim, N, causal): the shapes PERFORMANCE.md's targets care most about, and d=256.
SHAPES = [
    ("bf16", 64, 4096, False),
    ("bf16", 128, 1024, True),
    ("bf16", 128, 8192, False),
    ("bf16", 256, 2048, True),
    ("fp16", 128, 4096, False),
]
MODES = ("fwd", "fwd_bwd")


def _implementation_names():
    table = protocol.implementations()
    names = [n for n, impl in table.items() if impl.family == "mhattn" and not impl.is_reference]
    return names + ["sdpa-flash"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape_spec", SHAPES, ids=lambda s: f"{s[0]}-d{s[1]}-N{s[2]}-{'causal' if s[3] else 'full'}")
@pytest.mark.parametrize("impl_name", _implementation_names())
def test_attention(benchmark, impl_name, shape_spec, mode):
    impl = protocol.implementations()[impl_name]
    shape = protocol.protocol_shape(*shape_spec)
    q, k, v, dout = protocol.make_inputs(shape, "cuda")
    reasons = impl.unsupported(q, k, v, shape.causal)
    if reasons:
        pytest.skip(f"{impl_name} cannot run {shape.label()}: " + "; ".join(reasons))

    def forward():
        return impl(q, k, v, shape.causal)

    def forward_backward():
        return torch.autograd.grad(impl(q, k, v, shape.causal), (q, k, v), dout)

    body = forward if mode == "fwd" else forward_backward

    def step():
        body()
        torch.cuda.synchronize()

    with impl.context():
        try:
            step()  # compile / plan outside the timed rounds
        except Exception as error:
            if impl.family == "sdpa":
                pytest.skip(f"{impl_name}: {describe_error(error)}")
            raise
        benchmark.pedantic(step, rounds=30, iterations=1, warmup_rounds=5)
    median_s = benchmark.stats.stats.median
    benchmark.extra_info.update(
        impl=impl_name, shape=shape.as_dict(), mode=mode,
        tflops=round(protocol.flops(shape, mode) / median_s / 1e12, 1) if median_s > 0 else None,
    )
