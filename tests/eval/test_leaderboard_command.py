"""The command that puts a finished Predictor run on the leaderboard (predictor_training/eval/leaderboard_command.py):
the demo form and the real one."""

from __future__ import annotations

import json


def test_a_finished_run_is_told_its_leaderboard_command(tmp_path):
    """The recipes' closing line: the demo form for a dataset whose sample tables lie beside a demo_config.json, the
    real form (the user's $VAE) otherwise; the run's own training state, its trained plan, holdout25 first."""
    from predictor_training.eval.leaderboard_command import leaderboard_command
    demo, real = tmp_path / "assets", tmp_path / "data"
    (demo / "samples").mkdir(parents=True)
    (demo / "demo_config.json").write_text("{}")
    for root, tables in ((tmp_path / "demo_ds", demo / "samples"), (tmp_path / "real_ds", real / "samples")):
        root.mkdir()
        (root / "dataset_config.json").write_text(json.dumps({
            "splits": ["holdout50", "holdout25", "train"], "sample_tables": [str(tables / "train.jsonl")]}))
    line = leaderboard_command(tmp_path / "run", dataset_root=tmp_path / "demo_ds", world_size=1)
    assert line.startswith(f"python tools/leaderboard.py --demo {demo} --lpips_random_backbone --split holdout25")
    assert line.endswith(f"--ckpt {tmp_path / 'run' / 'training_latest.pt'} --predictor_plans trained")
    line = leaderboard_command(tmp_path / "run", dataset_root=tmp_path / "real_ds", world_size=8)
    assert line.startswith(f"torchrun --nproc_per_node 8 tools/leaderboard.py --samples_dir {real / 'samples'} "
                           f"--dataset_root {tmp_path / 'real_ds'} --vae $VAE")
