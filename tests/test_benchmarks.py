"""The benchmarks' own reference code: the rebuilt SpecForge anchor that training throughput is stated against."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.anchor import AnchorEagle3  # noqa: E402

TINY = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, vocab_size=100,
            draft_vocab_size=40)


def tiny_batch(B=2, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.zeros(B, T)
    loss_mask[:, T // 2:] = 1
    attention_mask = torch.ones(B, T)
    attention_mask[-1, -3:] = 0 if B > 1 else 1
    head = torch.randn(100, 32, generator=g)
    head[:40] *= 5                              # the target's top-1 lands in the draft vocabulary (ids < 40)
    return dict(input_ids=torch.randint(0, 100, (B, T), generator=g), loss_mask=loss_mask,
                attention_mask=attention_mask, features=torch.randn(B, T, 96, generator=g),
                target_hidden=torch.randn(B, T, 32, generator=g), lm_head_weight=head)


def test_anchor_step_trains_every_parameter_but_the_frozen_embedding():
    torch.manual_seed(0)
    model = AnchorEagle3(**TINY)
    loss = model(**tiny_batch(), steps=7)
    assert loss.ndim == 0 and torch.isfinite(loss) and loss > 0
    loss.backward()
    assert model.embed.weight.grad is None
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_anchor_prediction_reads_no_feature_after_its_position():
    """At every TTT step position t's prediction reads target features at or before t only (the causal prefix,
    then its own chain): changing features after the one scored position leaves the loss unchanged."""
    torch.manual_seed(0)
    model = AnchorEagle3(**TINY)
    data = tiny_batch(B=1, T=10)
    data["loss_mask"][:] = 0
    data["loss_mask"][0, 4] = 1                 # score position 4 only
    for steps in (1, 3):
        base = model(**data, steps=steps)
        assert base > 0
        changed = dict(data, features=data["features"].clone())
        changed["features"][0, 5:] += 5.0           # features after position 4
        assert torch.allclose(model(**changed, steps=steps), base)
        changed["features"][0, 2] += 5.0            # a feature before it
        assert not torch.allclose(model(**changed, steps=steps), base)


def test_study_parts_replays_every_part_of_the_study_profile_from_the_committed_rows():
    import subprocess

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "benchmarks/study_parts.py"], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    # a fresh workspace reuses the committed answers, so the regenerate time they took is not counted again
    seeded = any((root / "results/study/conversations").glob("*.jsonl.gz"))
    assert ("counted per part: prepare + features =" if seeded else "counted per part: prepare + regenerate + "
            "features =") in out.stdout.splitlines()[0]
    for part in ("injection/(whole)", "depth/seed0-shallow", "depth/seed0-deep", "depth/seed1", "hybrid/seed0",
                 "scale/small-seed0", "block/blocks-seeds12", "block/ar-seed2"):
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith(f"| {part} |"))
        # a part with trials not yet run reads "about N min" (estimated from paces)
        cells = line.split("|")
        replayed, unwaved, total = (float(c.replace("about", "").split()[0]) for c in (cells[3], cells[4], cells[6]))
        assert 0 < replayed < total and 0 < unwaved < total
    # a part run in one go shows its recorded wall time beside the estimate
    for part, run in json.loads((root / "results/study/parts.json").read_text()).items():
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith(f"| {part} |"))
        assert line.split("|")[7].strip().startswith(f"{run['wall_s'] / 60:.1f} min")


def test_gpu_checks_hold_on_the_cpu():
    """The `gpu` tests (tests/test_gpu.py, run on a GPU by benchmarks/gpu_check.py) run on the CPU too, so they are
    exercised where no GPU is; the two that read the CUDA allocator skip."""
    import os
    import subprocess

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, KVSHOT_GPU_TEST_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "126 passed, 4 skipped" in out.stdout, out.stdout[-1000:]


def test_gpu_check_summary_compares_the_fused_path_with_the_masked_one():
    import benchmarks.gpu_check as gpu_check
    import models.layers

    rows = [dict(drafter="eagle3", attention="fused", step_s=0.3, peak_step_GiB=6.0, resident_GiB=9.0,
                 loss_tokens_per_s=100),
            dict(drafter="eagle3", attention="masked", step_s=0.4, peak_step_GiB=12.0, resident_GiB=9.0,
                 loss_tokens_per_s=75),
            dict(drafter="hybrid", attention="fused", error="RuntimeError: out of memory")]
    table = gpu_check.summary_table(rows).splitlines()
    assert table[1].split() == ["eagle3", "0.300", "1.00", "6.00", "9.00", "100", "0.75", "0.50"]
    assert table[2].startswith("hybrid") and "FAILED RuntimeError" in table[2]
    with gpu_check.attention_path(masked=True):
        assert models.layers.causal_lse_kernel(torch.zeros(1, 1, 4, 8)) is None
    assert models.layers.causal_lse_kernel(torch.zeros(1, 1, 4, 8)) == "cpu_flash"
