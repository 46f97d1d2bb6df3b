"""Optimizer step time of DisTrOAdamW and DeMo against torch.optim.AdamW(foreach=True), and bytes per step.

Shapes: a ~5M-parameter Llama-style transformer (4 layers, width 256, SwiGLU FFN 1024, vocab 4096,
tied embeddings), or with ``--model 1.2b`` the DisTrO report's (16 layers, width 2048, FFN 8192,
vocab 32000, tied here: 1.14B parameters; for a GPU, ~80 GB with all arms). Gradients are random;
one worker (the collective is then a local copy), so what is timed is the optimizer's own work:
DCT, top-k, quantization, packing, decoding, aggregation.
"ops per step" counts the aten operations one step dispatches, views left out (after the timed
rounds): on a GPU each is about one kernel launch, and where the step is bound by the host (a GPU at
these sizes), the launches are its time. The native DCT kernel's work is one call, not counted.
The arms are timed in interleaved rounds so machine noise hits them alike; the table reports the
median per-step time and the median over rounds of the ratio to AdamW within each round. On the CPU
its header names the CPU and gives two quick probes taken after the rounds, float32 GEMM GFLOP/s and
memory copy GB/s: one VM type's name can cover CPUs of very different speed.

    python benchmarks/bench_step.py [--steps 20] [--rounds 5] [--threads 2] [--device cuda] [--model 1.2b]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distro_opt import DCTTransform, DeMo, DisTrOAdamW, native
from distro_opt.cli_args import at_least


MODELS = {"5m": dict(layers=4, width=256, ffn=1024, vocab=4096),
          "1.2b": dict(layers=16, width=2048, ffn=8192, vocab=32000)}


def transformer_shapes(layers=4, width=256, ffn=1024, vocab=4096):
    shapes = [(vocab, width)]
    for _ in range(layers):
        shapes += [(width,), (width, width), (width, width), (width, width), (width, width)]  # norm, q k v o
        shapes += [(width,), (ffn, width), (ffn, width), (width, ffn)]  # norm, gate, up, down
    return shapes + [(width,)]


class ForwardDCTOnly:
    """Not an optimizer: the chunked forward DCT of every gradient, the one part of a DeMo-style step
    that touches every coefficient with O(chunk) flops each, by the path the step takes (the native
    kernel's 2 x 22 multiply-adds per element for float32 matrices of 64x64 chunks where it runs,
    else two GEMMs' 2 x 64)."""

    def __init__(self, params, chunk=64):
        self.params = list(params)
        self.transform = DCTTransform()
        self.chunks = [DCTTransform.chunk_shape(p.shape, chunk) for p in self.params]

    def step(self):
        for p, chunk in zip(self.params, self.chunks):
            self.transform.forward(p.grad, chunk)


class GemmPath:
    """DisTrOAdamW with DeMo's rule (``update="sign"``: 64x64 chunks, which the native kernel serves),
    its forward DCT on the GEMM path (oneDNN or MKL) instead of the native kernel
    (``distro_opt.native.disabled()`` around its own steps): what that step costs where the kernel
    is not built."""

    def __init__(self, params):
        self.optimizer = DisTrOAdamW(params, lr=1e-3, update="sign")
        self.payload_nbytes = self.optimizer.payload_nbytes

    def step(self):
        with native.disabled():
            self.optimizer.step()


class WithBf16Gemms:
    """DisTrOAdamW with its defaults (16x16 chunks: the GEMM path), stepped with
    ``torch.backends.mkldnn.matmul.fp32_precision`` set to "bf16" (the user's process-wide permission for bf16 float32 matmuls, which its forward
    DCT's oneDNN GEMMs then take on a CPU that computes bf16) around its own steps only, so that
    the other arms run with torch's default."""

    def __init__(self, params):
        self.optimizer = DisTrOAdamW(params, lr=1e-3)
        self.payload_nbytes = self.optimizer.payload_nbytes

    def step(self):
        matmul = getattr(torch.backends.mkldnn, "matmul", None)  # torch < 2.9 has no such setting
        if matmul is None:
            return self.optimizer.step()
        before = matmul.fp32_precision
        matmul.fp32_precision = "bf16"
        try:
            self.optimizer.step()
        finally:
            matmul.fp32_precision = before


ARMS = {
    "AdamW (torch, foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "DisTrOAdamW (defaults)": lambda ps: DisTrOAdamW(ps, lr=1e-3),
    "DisTrOAdamW (update=sign: DeMo's rule, 64x64)": lambda ps: DisTrOAdamW(ps, lr=1e-3, update="sign"),
    "DisTrOAdamW (update=sign, GEMM path)": GemmPath,
    "DisTrOAdamW (defaults, bf16 GEMMs allowed)": WithBf16Gemms,
    "DisTrOAdamW (update=adam)": lambda ps: DisTrOAdamW(ps, lr=1e-3, update="adam", compression_chunk=16),
    "DeMo (reference settings)": lambda ps: DeMo(ps, lr=1e-3),
    "forward DCT alone (not an optimizer)": ForwardDCTOnly,
}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(opt, params, grads, steps):
    for p, g in zip(params, grads):
        p.grad = g
    device = params[0].device
    synchronize(device)  # a GPU's queued work is timed where it runs, not where it was launched
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


class CountOps(TorchDispatchMode):
    """Counts the aten operations dispatched inside the block, views (which launch nothing) left out."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def ops_per_step(opt) -> int:
    """The aten operations of one more step of ``opt`` (its gradients already in place)."""
    with CountOps() as counter:
        opt.step()
    return counter.count


def timing_setup(description, argv, threads=2, rounds=5, steps=20, extra=None):
    """Parse the timing options shared by the benchmarks (``extra(parser)`` adds more), set torch's
    threads and seed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=at_least(int, 1), default=steps,
                        help="steps (repetitions) per timed round")
    parser.add_argument("--rounds", type=at_least(int, 1), default=rounds, help="interleaved rounds per arm")
    parser.add_argument("--threads", type=at_least(int, 1), default=threads, help="torch intra-op threads")
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return args


def cpu_name() -> str:
    """The CPU's model name, with family and model numbers where Linux gives them (one VM type's
    name, e.g. "AMD EPYC", can cover CPUs of very different speed)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    name = fields.get("model name", platform.machine())
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def machine_speeds() -> str:
    """Two quick probes that tell machines (and a shared VM's states) apart: float32 GEMM throughput
    (1024^3 torch.mm) and memory bandwidth (a 64 MB copy), each the best of several tries."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    src, dst = torch.randn(1 << 24), torch.empty(1 << 24)

    def best(fn, tries):
        fn()
        times = []
        for _ in range(tries):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    gflops = 2 * 1024**3 / best(lambda: torch.mm(a, b), 10) / 1e9
    gbps = 2 * src.numel() * src.element_size() / best(lambda: dst.copy_(src), 10) / 1e9
    return f"GEMM {gflops:.0f} GFLOP/s, copy {gbps:.0f} GB/s"


def parse_device(text):
    try:
        return torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (e.g. cpu, cuda, cuda:1)") from None


def add_model_options(parser):
    parser.add_argument("--model", choices=sorted(MODELS), default="5m", help="whose shapes (default 5m)")
    parser.add_argument("--device", type=parse_device, default="cpu",
                        help="where the tensors live: cpu (default), cuda, cuda:1")


def main(argv=None):
    args = timing_setup(__doc__.splitlines()[0], argv, extra=add_model_options)
    device = args.device
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA GPU here")
    shapes = transformer_shapes(**MODELS[args.model])
    nparams = sum(torch.Size(s).numel() for s in shapes)
    setups = {}
    for name, make in ARMS.items():
        if make in (WithBf16Gemms, GemmPath) and device.type != "cpu":  # CPU settings: the defaults there
            continue
        params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
        grads = [torch.randn(s, device=device) * 1e-3 for s in shapes]
        opt = make(params)
        time_steps(opt, params, grads, 2)  # warm-up: lazy state, caches
        setups[name] = (opt, params, grads, [])
    for _ in range(args.rounds):
        for opt, params, grads, times in setups.values():
            times.append(time_steps(opt, params, grads, args.steps))
    ops = {name: ops_per_step(opt) for name, (opt, _, _, _) in setups.items()}
    dense_bf16 = 2 * nparams
    if device.type == "cpu":  # the machine's probes run after the timed rounds, so as not to disturb them
        threads = torch.get_num_threads()
        where = (f"{threads} thread{'s' * (threads != 1)}, {cpu_name()}, {machine_speeds()}, "
                 f"native DCT kernel: {native.status()}")
    else:
        where = torch.cuda.get_device_name(device)
    print(f"{nparams / 1e6:.2f}M parameters, {where}, torch {torch.__version__}\n")
    print("| optimizer | step (ms) | vs AdamW | ops per step | bytes sent per step | bytes/param | vs dense bf16 |")
    print("|---|---|---|---|---|---|---|")
    for name, (opt, _, _, times) in setups.items():
        ms = statistics.median(times) * 1e3
        # the ratio is taken within each round (AdamW timed right before), then the median over rounds:
        # on a shared machine that is steadier than a ratio of two medians
        ratio = statistics.median(t / b for t, b in zip(times, setups["AdamW (torch, foreach)"][3]))
        nbytes = getattr(opt, "payload_nbytes", None)
        if isinstance(opt, ForwardDCTOnly):
            cols = "- | - | -"
        elif nbytes is None:
            cols = "dense gradient (all-reduce) | 2 (bf16) | 1x"
        else:
            cols = f"{nbytes:,} | {nbytes / nparams:.4f} | {dense_bf16 / nbytes:,.0f}x"
        print(f"| {name} | {ms:.1f} | {ratio:.2f}x | {ops[name]:,} | {cols} |")


if __name__ == "__main__":
    main()
