"""Stage two: train a drafter from a store, one process per device (docs/DESIGN.md §3, §4, §7).

launch (processes) -> preflight (checks, once per run: the resolved run every process receives) ->
trainer (the loop), fed by plan (an epoch's packing and order) -> loader (micro-batches in worker
processes) -> batch_slots / feeder (to the device); loss, checkpoint, metrics, tracker (a step's timing
and its record, read one step late), parallel (DDP / FSDP2), heldout (held-out tau during training).
"""
