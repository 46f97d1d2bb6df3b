"""The step benchmark runs end to end and reports what it claims: every arm, the machine, and the
optimizers' own byte counts (one short round: only that it works is checked, not any time)."""
import importlib.util
import pathlib
import re

import pytest
import torch

from distro_opt import DisTrOAdamW, DeMo

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_step.py"


@pytest.fixture
def bench():
    """The script as a module; torch's thread count and random state, which it sets, are restored."""
    spec = importlib.util.spec_from_file_location("bench_step", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    yield module
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)


def test_one_short_round_prints_every_arm_the_machine_and_the_payload_bytes(bench, capsys):
    bench.main(["--rounds", "1", "--steps", "1", "--threads", "1"])
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "1 thread," in header and bench.cpu_name() in header
    assert re.search(r"GEMM \d+ GFLOP/s, copy \d+ GB/s", header)
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(bench.ARMS) <= set(rows)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in bench.transformer_shapes()]
    for name in ("DisTrOAdamW (defaults)", "DeMo (reference settings)"):
        opt = bench.ARMS[name](params)
        assert isinstance(opt, (DisTrOAdamW, DeMo))
        assert f"| {opt.payload_nbytes:,} |" in rows[name]
    ops = {name: int(line.split("|")[4].replace(",", "")) for name, line in rows.items() if name in bench.ARMS}
    assert all(n > 0 for n in ops.values())


def test_ops_per_step_counts_each_operation_and_leaves_views_out(bench):
    class Step:
        def __init__(self):
            self.x = torch.zeros(4, 4)

        def step(self):
            self.x.add_(1)
            y = self.x.view(-1)[2:].t()  # views only: nothing to launch
            y.mul_(2)
            torch._foreach_add_([self.x, y], 1.0)  # one op for both tensors

    assert bench.ops_per_step(Step()) == 3


def test_an_unknown_device_is_refused_with_a_clear_message(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "gpu0"])
    assert "not a torch device: 'gpu0'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--rounds", "--steps", "--threads"])
def test_a_count_below_one_is_a_usage_error_before_any_work(bench, capsys, flag):
    with pytest.raises(SystemExit) as exit_info:
        bench.main([flag, "0"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: '0': expected a number >= 1" in capsys.readouterr().err
