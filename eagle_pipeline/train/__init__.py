"""Stage 04's training: an EAGLE-3 drafter trained by speculators 0.9.0's own trainer.

The training loop, data loader, losses and checkpointer are speculators', driven through its CLI entry
point (`speculators.train.cli.main(TrainConfig.resolve(argv))`, the flags of `speculators train`). The
settings are the run config's `train` section (`eagle_pipeline.config.TrainConfig`); `settings.TrainRun`
holds the rest a run needs (paths, layer ids, seed, storage dtype, device). A run writes:

  out_dir/
    draft_config.json     the draft decoder (LlamaConfig), passed as --draft-config
    checkpoints/<epoch>/  speculators' checkpoints (model, optimizer, scheduler, training_state.json)
                          plus validation.json, written here once the epoch is validated
    best.json             the checkpoint with the lowest validation loss
    metrics.csv           loss and per-position accuracy (full_acc_k, cond_acc_k), train and val
    loss_curves.png       the same, plotted when the run ends
    run_stats.json        tokens/s, peak RSS and resume point of the latest invocation that trained
    tensorboard/          speculators' TensorBoard events
"""
