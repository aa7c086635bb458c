"""Stage 04's training: an EAGLE-3 drafter trained by speculators 0.9.0's own trainer.

The training loop, data loader, losses and checkpointer are speculators', driven through its CLI entry
point (`speculators.train.cli.main(TrainConfig.resolve(argv))`, the flags of `speculators train`). The
settings are the run config's `train` section (`eagle_pipeline.config.TrainConfig`); `settings.TrainRun`
holds the rest a run needs (paths, layer ids, seed, storage dtype, device). What a run writes under out_dir is
its module's: draft_config.json (draft_config.py, passed as --draft-config), checkpoints/<epoch>/ and best.json
(checkpoints.py), metrics.csv and loss_curves.png (metrics.py), run_stats.json (runner.py), split_data/ and
split.json (topic_split.py), tensorboard/ (speculators' events).
"""
