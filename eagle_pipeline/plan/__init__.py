"""The run's plan: what is checked and estimated before any work, from the config, the target's config.json and
what earlier stages recorded, without loading a model.

- preconditions.py  what every stage checks first, dry run included (folders, parallel split, GPUs, disk budget)
- engines.py        the vLLM engines each stage starts, their arguments, and how many times a run starts the target
- rehearsal.py      those engines configured by vLLM's own code (eagle_pipeline/vllm_config.py) before the first
                    model load
- disk.py           the disk each stage writes, for the budget check, the dry run and stage 02's reservation

The GPU memory of online training (co-located or time-sliced) is planned by online/memory.py, whose plan also
sizes the capture server stage 04 starts.

A new check of the config against the target or the host goes into preconditions.py when every stage should make
it, and into the stage script's dry-run path when only that stage reads what it checks. A new estimate goes beside
the others here; what it estimates (a drafter's shape, a sample's layout) is built by the module that owns it.
"""
