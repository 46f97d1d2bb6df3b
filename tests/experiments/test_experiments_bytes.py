"""Per-step bytes from shapes: the DisTrO report's baseline and the optimizer's own payload size."""

from distro_opt import DisTrOAdamW
from distro_opt.comm import CommStats, SingleWorkerBackend
from distro_opt.experiments import bytes as bytes_cli
from distro_opt.experiments.model import build_model
from distro_opt.experiments.presets import get_preset


def test_report_baseline_is_31_times_2_4_gb():
    assert bytes_cli.report_baseline_bytes() == 31 * 2_400_000_000 == 74_400_000_000


def test_llama_naive_bf16_gather_is_31_copies_of_the_exact_gradient():
    result = bytes_cli.table(get_preset("llama-1.2b"), 32, "distro")
    row = next(r for r in result["rows"] if r["arm"] == "adamw naive gather bf16")
    assert row["received_bytes"] == 31 * 2 * 1_204_881_408
    ring = next(r for r in result["rows"] if r["arm"] == "adamw ring all-reduce bf16")
    assert ring["sent_bytes"] == CommStats.ring_all_reduce_bytes(2 * 1_204_881_408, 32)


def test_meta_device_payload_equals_the_payload_of_a_real_model():
    preset = get_preset("smoke")
    result = bytes_cli.table(preset, 4, "distro:topk=8,bits=2")
    row = next(r for r in result["rows"] if r["arm"] == "distro:topk=8,bits=2")
    model = build_model(preset.model_config(), seed=0)
    opt = DisTrOAdamW(model.parameters(), compression_topk=8, compression_bits=2, comm=SingleWorkerBackend())
    assert row["message_bytes"] == opt.payload_nbytes
    assert row["sent_bytes"] == CommStats.all_gather_bytes(opt.payload_nbytes, 4)


def test_cli_prints_the_reproduced_baseline(capsys):
    assert bytes_cli.main(["--preset", "llama-1.2b", "--workers", "32", "--settings", "distro"]) == 0
    out = capsys.readouterr().out
    assert "74.4 GB" in out and "distro " in out


def test_cli_rejects_an_unknown_preset_with_exit_code_2(capsys):
    assert bytes_cli.main(["--preset", "gpt5"]) == 2
    assert "Unknown preset 'gpt5'" in capsys.readouterr().err
